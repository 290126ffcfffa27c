"""``cplib_c::seq_halo`` and the short causal conv built on it
(cplib/hybrid/conv.py): on 1, 2 and 4 gloo ranks, sequential (uneven) and
head-tail shards, the extended pieces hold exactly the k - 1 positions before
each piece (zeros before the sequence), and a causal depthwise conv over them
gives the full sequence's outputs and input gradients (the weight's, summed
over the ranks); opcheck of the op and its backward; a piece shorter than
the halo raises ValueError on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from cplib.hybrid.conv import causal_conv_by_halo
from cplib.attention.names import Layout
from cplib.hybrid.layout import SequenceLayout
from harness import assert_close

WORLD_SIZES = [1, 2, 4]


def _layout(s: int, head_tail: bool) -> SequenceLayout:
    return SequenceLayout(dist.group.WORLD.group_name, dist.get_world_size(), dist.get_rank(),
                          s, Layout.HEAD_TAIL if head_tail else Layout.SEQUENTIAL)


def _local(layout: SequenceLayout, full: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return torch.cat([full.narrow(dim, start, n) for start, n in layout.pieces()], dim)


def _causal_conv(x, w, b=None, activation=None):
    """A causal depthwise conv (B, C, L) with (C, k) taps, as transformers' torch one."""
    out = F.conv1d(x, w.unsqueeze(1), b, padding=w.shape[-1] - 1, groups=x.shape[1])
    out = out[..., :x.shape[-1]]
    return F.silu(out) if activation == "silu" else out


def _check_conv(s: int, head_tail: bool, k: int) -> int:
    layout = _layout(s, head_tail)
    g = torch.Generator().manual_seed(s + k)
    x = torch.randn(2, 6, s, generator=g, dtype=torch.float64)
    w = torch.randn(6, k, generator=g, dtype=torch.float64)
    cot = torch.randn(2, 6, s, generator=g, dtype=torch.float64)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    want = _causal_conv(xr, wr, activation="silu")
    (want * cot).sum().backward()
    xl, wl = _local(layout, x).requires_grad_(), w.clone().requires_grad_()
    got = causal_conv_by_halo(_causal_conv, layout, xl, wl, None, {"activation": "silu"})
    (got * _local(layout, cot)).sum().backward()
    what = f"S={s} head_tail={head_tail} k={k} n={layout.world_size}"
    assert_close(got, _local(layout, want.detach()), what=f"{what}: out", atol=1e-12, rtol=0)
    assert_close(xl.grad, _local(layout, xr.grad), what=f"{what}: grad x", atol=1e-12, rtol=0)
    dist.all_reduce(wl.grad)
    assert_close(wl.grad, wr.grad, what=f"{what}: grad w (summed)", atol=1e-11, rtol=0)
    return 1


def _check_halo_values(s: int, head_tail: bool, halo: int) -> int:
    import cplib

    layout = _layout(s, head_tail)
    full = torch.arange(1.0, s + 1.0).view(1, 1, s).expand(2, 3, s).contiguous()
    ext = cplib.seq_halo(_local(layout, full), halo, dist.group.WORLD,
                         first_len=layout.first_len())
    padded = F.pad(full, (halo, 0))  # zero before the sequence
    want = torch.cat([padded[..., start:start + halo + n] for start, n in layout.pieces()], -1)
    assert torch.equal(ext, want), (layout, ext[0, 0], want[0, 0])
    return 1


def _check_all() -> int:
    n = dist.get_world_size()
    count = 0
    for head_tail in (False, True):
        count += _check_halo_values(8 * n + (0 if head_tail else 3), head_tail, 3)
        for k in (1, 4):
            count += _check_conv(8 * n + (1 if head_tail else 5), head_tail, k)
    return count


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_causal_conv_by_halo_matches_the_full_sequence(ranks, world_size):
    assert ranks(world_size).run(_check_all) == [6] * world_size


def _check_opcheck() -> int:
    name = dist.group.WORLD.group_name
    x = torch.randn(2, 3, 9, dtype=torch.float64, requires_grad=True)
    for first in (-1, 4):
        args = (x, -1, 3, first, name)
        torch.library.opcheck(torch.ops.cplib_c.seq_halo.default, args)
        ext = torch.ops.cplib_c.seq_halo(*args)
        torch.library.opcheck(torch.ops.cplib_c.seq_halo_backward.default,
                              (torch.randn_like(ext), -1, 3, first, name))
    return 1


def test_opcheck(ranks):
    assert ranks(2).run(_check_opcheck) == [1, 1]


def _check_short_piece() -> list[str]:
    import cplib

    n = dist.get_world_size()
    # Rank 1's pieces are 2 positions: fewer than the halo of 3.
    x = torch.randn(1, 2, 4 if dist.get_rank() == 0 else 4)
    try:
        cplib.seq_halo(x, 3, dist.group.WORLD, first_len=2 if dist.get_rank() == 1 else 3)
    except ValueError as exc:
        return [str(exc)]
    return [f"no error on {n} ranks"]


def test_short_piece_raises_on_every_rank(ranks):
    results = ranks(2).run(_check_short_piece)
    assert results[0] == results[1], results
    assert "at least the halo of 3" in results[0][0], results
