"""The fused C merge kernel (cplib_c::merge_partial_) against an fp64 reference."""

from __future__ import annotations

import pytest
import torch

import cplib
from harness import assert_close


def _reference(out, lse, blk_out, blk_lse, row0):
    out, lse = out.double().clone(), lse.double().clone()
    rows = slice(row0, row0 + blk_out.shape[2])
    a, c = lse[:, :, rows], blk_lse.double()
    new = torch.logaddexp(a, c)
    wa = torch.where(a == -torch.inf, 0.0, torch.exp(a - new)).nan_to_num(0.0)
    wc = torch.where(c == -torch.inf, 0.0, torch.exp(c - new)).nan_to_num(0.0)
    mixed = out[:, :, rows] * wa[..., None] + blk_out.double() * wc[..., None]
    keep = (c == -torch.inf)[..., None]
    out[:, :, rows] = torch.where(keep, out[:, :, rows], mixed)
    lse[:, :, rows] = torch.where(c == -torch.inf, a, new)
    return out, lse


def _case(acc_dtype, blk_dtype, B=2, H=3, L=11, R=5, D=37, row0=4, strided=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(B, H, L, D, generator=g, dtype=acc_dtype)
    lse = torch.randn(B, H, L, generator=g, dtype=acc_dtype) * 3
    blk_out = torch.randn(B, H, R, D, generator=g, dtype=torch.float64).to(blk_dtype)
    blk_lse = torch.randn(B, H, R, generator=g, dtype=acc_dtype) * 3
    lse[0, 0, row0] = -torch.inf          # empty accumulator row
    blk_lse[0, 1, 0] = -torch.inf         # block saw no key for this row
    if strided:  # the CPU flash kernel's lse and a transposed block are not contiguous
        blk_out = blk_out.transpose(1, 2).contiguous().transpose(1, 2)
        blk_lse = blk_lse.transpose(0, 2).contiguous().transpose(0, 2)
    return out, lse, blk_out, blk_lse, row0


@pytest.mark.parametrize("acc_dtype,blk_dtype", [
    (torch.float32, torch.float32), (torch.float32, torch.bfloat16),
    (torch.float32, torch.float16), (torch.float64, torch.float64)])
@pytest.mark.parametrize("strided", [False, True])
def test_merge_matches_reference(acc_dtype, blk_dtype, strided):
    out, lse, blk_out, blk_lse, row0 = _case(acc_dtype, blk_dtype, strided=strided)
    ref_out, ref_lse = _reference(out, lse, blk_out, blk_lse, row0)
    cplib.merge_partial_(out, lse, blk_out, blk_lse, row0)
    tol = 1e-12 if acc_dtype == torch.float64 else 2e-6
    assert_close(out.double(), ref_out, atol=tol, rtol=tol, what="merged out")
    assert_close(lse.double(), ref_lse, atol=tol, rtol=tol, what="merged lse")


def test_merge_of_split_softmax_equals_full_softmax():
    # Two halves of the keys merged exactly reproduce attention over all keys.
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=g, dtype=torch.float64) for _ in range(3))
    def part(kk, vv):
        s = q @ kk.transpose(-1, -2)
        return torch.softmax(s, -1) @ vv, torch.logsumexp(s, -1)
    o1, l1 = part(k[:, :, :3], v[:, :, :3])
    o2, l2 = part(k[:, :, 3:], v[:, :, 3:])
    full, _ = part(k, v)
    cplib.merge_partial_(o1, l1, o2, l2, 0)
    assert_close(o1, full, atol=1e-12, rtol=1e-12, what="merged attention")


def test_merge_rejects_bad_arguments():
    out, lse, blk_out, blk_lse, _ = _case(torch.float32, torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        cplib.merge_partial_(out, lse, blk_out, blk_lse, 9)
    with pytest.raises(ValueError, match="accumulator dtype"):
        cplib.merge_partial_(out.half(), lse, blk_out, blk_lse, 0)
    with pytest.raises(ValueError, match="float64 block"):
        cplib.merge_partial_(out.double(), lse.double(), blk_out, blk_lse.double(), 0)


def test_merge_opcheck():
    out, lse, blk_out, blk_lse, row0 = _case(torch.float32, torch.bfloat16)
    torch.library.opcheck(torch.ops.cplib_c.merge_partial_.default,
                          (out, lse, blk_out, blk_lse, row0))


@pytest.mark.parametrize("blk_dtype", [torch.float32, torch.bfloat16])
def test_merge_extreme_lse_gaps(blk_dtype):
    # The vectorised exp/log1p: gaps from 0 to beyond float's exp range, both
    # signs, ties, and -inf on either side or both, against fp64.
    gaps = torch.tensor([0.0, 1e-7, 1e-3, 0.3466, 0.5, 1.0, 5.0, 17.0, 30.0, 86.9, 87.5, 100.0,
                         1e4, torch.inf])
    a = torch.cat([torch.zeros_like(gaps), -gaps, torch.full_like(gaps, 3.0)])
    c = torch.cat([-gaps, torch.zeros_like(gaps), 3.0 - gaps])
    end = torch.tensor([-torch.inf])
    a, c = torch.cat([a, c, end]), torch.cat([c, a, end])
    R, D = a.numel(), 19
    g = torch.Generator().manual_seed(5)
    out = torch.randn(1, 1, R, D, generator=g)
    blk_out = torch.randn(1, 1, R, D, generator=g, dtype=torch.float64).to(blk_dtype)
    lse, blk_lse = a.view(1, 1, R).clone(), c.view(1, 1, R).clone()
    ref_out, ref_lse = _reference(out, lse, blk_out, blk_lse, 0)
    cplib.merge_partial_(out, lse, blk_out, blk_lse, 0)
    assert_close(out.double(), ref_out, atol=2e-6, rtol=2e-6, what="merged out")
    assert torch.equal(lse.isinf(), ref_lse.isinf()), "lse -inf pattern"
    finite = ref_lse.isfinite()
    # lse is near 0 where the max is 0: judge it at float resolution of O(1)
    assert_close(lse.double()[finite], ref_lse[finite], atol=1e-7, rtol=2.5e-7, what="merged lse")


@pytest.mark.parametrize("acc_dtype", [torch.float32, torch.float64])
def test_merge_rows_across_chunks_and_threads(acc_dtype):
    # 517 rows span three 256-row chunks with a ragged end; B*H*R*D is past
    # the threshold where the rows are split across OpenMP threads.
    out, lse, blk_out, blk_lse, row0 = _case(acc_dtype, acc_dtype, B=2, H=3, L=600, R=517, D=40,
                                             row0=50, seed=7)
    ref_out, ref_lse = _reference(out, lse, blk_out, blk_lse, row0)
    cplib.merge_partial_(out, lse, blk_out, blk_lse, row0)
    tol = 1e-12 if acc_dtype == torch.float64 else 2e-6
    assert_close(out.double(), ref_out, atol=tol, rtol=tol, what="merged out")
    assert_close(lse.double(), ref_lse, atol=tol, rtol=tol, what="merged lse")
