"""cplib_c::combine_partials_ (csrc/core/combine.c): several partial results
combined in one pass, each row written once, against float64 references.

The ring holds each step's partial attention output (q's dtype) with its lse
and combines them at the end (csrc/torch/merge/partial_sum.h); the backward
sums dq's partial gradients the same way, unweighted. Checked: the weighted
combine and its lse, parts over any rows (uncovered rows give 0 and lse
-inf), a part whose rows saw no key (lse -inf: its values, NaN here, are not
read), an accumulator folded in place (out is one of the parts), strided
parts, a plain sum, float64, and the rounding of the output: exactly
torch's round-to-nearest-even of the float32 value, in bfloat16 and float16
(subnormals, ties, overflow). benchmarks/gpu/kernels_check.py runs the
same cases on the CUDA kernel against this C one."""

from __future__ import annotations

import itertools

import pytest
import torch

import cplib  # noqa: F401  (loads the ops)
from cplib.merge.op import combine_partials_

HALF = (torch.bfloat16, torch.float16)


def case(out_dtype: torch.dtype, part_dtype: torch.dtype, *, rows: int = 37, dim: int = 24,
         spans=((0, 3), (5, 20), (14, 23), (30, 7)), acc_part: bool = False,
         strided: bool = False, no_key_rows: bool = True, seed: int = 0):
    """(parts, lses, offsets, rows, dim): partial outputs of random values
    (part 0 of the accumulator dtype when ``acc_part``), lses around 0 with
    some rows of part 1 at -inf and NaN values there."""
    g = torch.Generator().manual_seed(seed)
    acc = torch.float64 if out_dtype == torch.float64 else torch.float32
    b, h = 2, 3
    parts, lses, offsets = [], [], []
    for j, (off, n) in enumerate(spans):
        dt = acc if (acc_part and j == 0) else part_dtype
        if strided:  # (B, L, H, D) memory, as CUDA flash returns it
            x = torch.randn(b, n, h, dim, generator=g, dtype=torch.float64).to(dt).transpose(1, 2)
        else:
            x = torch.randn(b, h, n, dim, generator=g, dtype=torch.float64).to(dt)
        lse = (torch.randn(b, h, n, generator=g, dtype=torch.float64) * 3).to(acc)
        if j == 1 and no_key_rows:
            lse[:, :, ::3] = -float("inf")
            x[:, :, ::3] = float("nan")
        parts.append(x)
        lses.append(lse)
        offsets.append(off)
    return parts, lses, offsets, rows, dim


def reference(parts, lses, offsets, rows, weighted=True):
    """float64 (out, lse) of the combination."""
    b, h, _, d = parts[0].shape
    big = torch.full((len(parts), b, h, rows), -float("inf"), dtype=torch.float64)
    for j, (x, lse, off) in enumerate(zip(parts, lses, offsets)):
        big[j, :, :, off:off + x.shape[2]] = lse.double() if weighted else 0.0
    lse = torch.logsumexp(big, 0)
    out = torch.zeros(b, h, rows, d, dtype=torch.float64)
    for j, (x, off) in enumerate(zip(parts, offsets)):
        sl = slice(off, off + x.shape[2])
        w = torch.exp(big[j, :, :, sl] - lse[:, :, sl]) if weighted else \
            torch.ones_like(big[j, :, :, sl])
        contrib = torch.where(w[..., None] > 0, w[..., None] * x.double(), 0.0)
        out[:, :, sl] += torch.nan_to_num(contrib, nan=0.0)
    out[lse == -float("inf")] = 0.0
    return out, lse


def assert_rounded_once(out: torch.Tensor, want: torch.Tensor) -> None:
    """``out`` (fp16/bf16) is ``want`` (float64) rounded once: equal to
    torch's rounding of it but where float32 arithmetic lands on the other
    side of a tie (within one step of the output dtype)."""
    rounded = want.to(out.dtype)
    step = torch.finfo(out.dtype).eps * want.abs().clamp_min(torch.finfo(out.dtype).tiny)
    assert ((out.double() - want).abs() <= step).all()
    assert (out == rounded).float().mean() > 0.999, (out != rounded).sum()


def _run(out_dtype, parts, lses, offsets, rows, dim, weighted=True):
    b, h = parts[0].shape[:2]
    acc = torch.float64 if out_dtype == torch.float64 else torch.float32
    out = torch.full((b, h, rows, dim), 7.0, dtype=out_dtype)
    lse = torch.full((b, h, rows), 7.0, dtype=acc)
    combine_partials_(out, lse if weighted else None, parts, lses if weighted else None, offsets)
    return out, lse


@pytest.mark.parametrize("out_dtype,part_dtype,acc_part,strided", [
    (torch.float32, torch.float32, False, False), (torch.bfloat16, torch.bfloat16, False, True),
    (torch.float16, torch.float16, True, False), (torch.float32, torch.bfloat16, True, True),
    (torch.float64, torch.float64, False, True)])
def test_weighted_combine_matches_float64(out_dtype, part_dtype, acc_part, strided):
    parts, lses, offsets, rows, dim = case(out_dtype, part_dtype, acc_part=acc_part,
                                           strided=strided)
    out, lse = _run(out_dtype, parts, lses, offsets, rows, dim)
    want_out, want_lse = reference(parts, lses, offsets, rows)
    tol = 1e-12 if out_dtype == torch.float64 else 2e-6
    torch.testing.assert_close(lse.double(), want_lse, atol=tol, rtol=tol)
    assert torch.isinf(lse[:, :, 3:5]).all() and (out[:, :, 3:5] == 0).all()  # no part there
    if out_dtype in HALF:
        assert_rounded_once(out, want_out)
    else:
        torch.testing.assert_close(out.double(), want_out, atol=tol, rtol=tol)


def test_a_strided_float_output():
    """A float32 output whose rows are not contiguous ((B, L, H, D) memory) is
    written through the row buffer, as the half outputs are; a contiguous one
    takes each row's sum directly."""
    parts, lses, offsets, rows, dim = case(torch.float32, torch.float32)
    b, h = parts[0].shape[:2]
    out = torch.full((b, rows, h, dim), 7.0).transpose(1, 2)
    lse = torch.empty(b, h, rows)
    combine_partials_(out, lse, parts, lses, offsets)
    want_out, want_lse = reference(parts, lses, offsets, rows)
    torch.testing.assert_close(out.double(), want_out, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-6, rtol=2e-6)


def test_plain_sum_and_uncovered_rows():
    parts, _, offsets, rows, dim = case(torch.float32, torch.bfloat16, no_key_rows=False)
    out, _ = _run(torch.bfloat16, parts, None, offsets, rows, dim, weighted=False)
    want, _ = reference(parts, [torch.zeros(p.shape[:3]) for p in parts], offsets, rows,
                        weighted=False)
    assert_rounded_once(out, want)
    assert (out[:, :, 3:5] == 0).all()


def test_an_accumulator_folds_in_place():
    """What the ring does past its budget: the accumulator is part 0 and the output."""
    parts, lses, offsets, rows, dim = case(torch.float32, torch.bfloat16, no_key_rows=False)
    acc = torch.randn(2, 3, rows, dim)
    acc_lse = torch.randn(2, 3, rows)
    want, want_lse = reference([acc, *parts[1:]], [acc_lse, *lses[1:]], [0, *offsets[1:]], rows)
    new_lse = torch.empty_like(acc_lse)
    combine_partials_(acc, new_lse, [acc, *parts[1:]], [acc_lse, *lses[1:]], [0, *offsets[1:]])
    torch.testing.assert_close(acc.double(), want, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(new_lse.double(), want_lse, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("dtype", HALF)
def test_rounding_is_torchs(dtype):
    """Signed zeros, subnormals, ties, the largest finite values and overflow:
    one fp32 part summed alone rounds exactly as torch's cast (a row's sum
    starts from its first part, not from +0, so -0 stays -0)."""
    info = torch.finfo(dtype)
    special = torch.tensor([0.0, -0.0, info.tiny, info.tiny / 3, info.smallest_normal * 0.75,
                            2 ** -25, 2 ** -25 * 1.0001, 2 ** -24 * 1.5, 2 ** -24 * 2.5,
                            info.max, -info.max, info.max * 1.0009, 65519.0, 65520.0, 1e30,
                            -1e30, float("inf"), -float("inf"), 1.0 + 2 ** -9, 1.0 + 3 * 2 ** -9,
                            1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11, 3.14159, -2.71828],
                           dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    x = torch.cat([special, torch.randn(1000, generator=g) * 10 ** torch.randint(
        -8, 6, (1000,), generator=g).float()]).reshape(1, 1, -1, 8)
    out = torch.empty(x.shape, dtype=dtype)
    combine_partials_(out, None, [x], None, [0])
    want = x.to(dtype)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16)), \
        (x[out.view(torch.int16) != want.view(torch.int16)], out[out != want], want[out != want])


def test_bad_arguments_are_value_errors():
    parts, lses, offsets, rows, dim = case(torch.float32, torch.bfloat16)
    out, lse = torch.empty(2, 3, rows, dim), torch.empty(2, 3, rows)
    with pytest.raises(ValueError, match="at most 8 parts"):
        combine_partials_(out, lse, parts * 3, lses * 3, offsets * 3)
    with pytest.raises(ValueError, match="does not fit"):
        combine_partials_(out, lse, parts, lses, [o + 10 for o in offsets])
    with pytest.raises(ValueError, match="dtypes out of reach"):
        combine_partials_(out, lse, [parts[1], parts[2].half()], lses[1:3], offsets[1:3])


def test_every_split_of_rows_gives_one_result():
    """Parts over overlapping rows in any order: the same combination."""
    parts, lses, offsets, rows, dim = case(torch.float32, torch.float32, no_key_rows=False)
    first, _ = _run(torch.float32, parts, lses, offsets, rows, dim)
    for order in itertools.islice(itertools.permutations(range(len(parts))), 1, 6):
        got, _ = _run(torch.float32, [parts[i] for i in order], [lses[i] for i in order],
                      [offsets[i] for i in order], rows, dim)
        torch.testing.assert_close(got, first, atol=1e-6, rtol=1e-6)
