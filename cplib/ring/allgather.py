"""All-gather attention as Llama 3 runs its context parallelism (issue 54).

K and V are gathered from every rank once (one all-gather; its backward one
sum reduce-scatter of dK/dV: ``cplib_c::flex_cp_allgather`` and its covered
backward), put in global order, and each of this rank's query chunks (one
in the sequential layout, chunks r and 2N-1-r in the head-tail one) attends,
in ONE call, the keys it can see: under a causal mask the prefix up to its
last row, aligned to the bottom right (the chunk's last query sees every key
up to its own position; ``causal_lower_right``, which flash serves as it
is), narrowed by a window and cut to the documents the chunk holds (an
explicit mask over the keys in reach). No partial results and no merge:
every output row comes from one kernel call, as on one device, and autograd
runs the same calls backwards. Memory: the whole sequence's K/V on every
rank (O(S); with GQA that is Hkv/Hq of q's size), as the ring's
``rotate="allgather"`` holds.

    out = cplib.ring.allgather.allgather_sdpa(q, k, v, group, is_causal=True,
                                              load_balanced=True)

Limits: equal shards (S divisible by N, or by 2N head-tail); no lse (the
output only); documents and windows in global positions as ``ring_sdpa``
takes them."""

from __future__ import annotations

import bisect

import torch
import torch.nn.attention.bias
import torch.nn.functional as F

from ..comm.native import GroupLike, group_name_of, group_size, ops

__all__ = ["allgather_sdpa", "query_chunks", "visible_keys"]


class _GatherKV(torch.autograd.Function):
    """K and V of every rank along the sequence, rank-major; backward: each
    rank gets the sum of every rank's gradient of its own rows."""

    @staticmethod
    def forward(ctx, k, v, group_name):
        ctx.group_name = group_name
        return tuple(ops.flex_cp_allgather(k, v, 2, group_name))

    @staticmethod
    def backward(ctx, gk, gv):
        dk, dv = ops.flex_cp_allgather_backward_covered(gk.contiguous(), gv.contiguous(), 2,
                                                         ctx.group_name)
        return dk, dv, None


def query_chunks(seq_len: int, world: int, rank: int, load_balanced: bool) -> list[tuple[int, int]]:
    """(global start, rows) of this rank's query chunks, in local order."""
    if not load_balanced:
        rows = seq_len // world
        return [(rank * rows, rows)]
    c = seq_len // (2 * world)
    return [(rank * c, c), ((2 * world - 1 - rank) * c, c)]


def _global_order(seq_len: int, world: int, load_balanced: bool) -> torch.Tensor | None:
    """Rows of the rank-major gather in global order (None: already are)."""
    if not load_balanced:
        return None
    idx = []
    for j in range(2 * world):  # global chunk j: rank j's first half, or 2N-1-j's second
        owner = j if j < world else 2 * world - 1 - j
        rows = seq_len // (2 * world)
        local = owner * 2 * rows + (0 if j < world else rows)
        idx.extend(range(local, local + rows))
    return torch.tensor(idx)


def visible_keys(start: int, rows: int, seq_len: int, is_causal: bool,
                 window: tuple[int | None, int | None] | None,
                 bounds: list[int] | None) -> tuple[int, int]:
    """[lo, hi): the keys some query of rows [start, start + rows) can see."""
    left, right = window if window is not None else (None, None)
    lo = 0 if left is None else max(0, start - left)
    last = start + rows - 1
    hi = last + 1 if is_causal else (seq_len if right is None else min(seq_len, last + right + 1))
    if bounds:
        lo = max(lo, bounds[bisect.bisect_right(bounds, start) - 1])
        hi = min(hi, bounds[bisect.bisect_right(bounds, last)])
    return lo, hi


def _mask(start: int, rows: int, lo: int, hi: int, is_causal: bool, window, bounds,
          device) -> torch.Tensor:
    """(rows, hi - lo) boolean mask, True = attend, in global positions."""
    qp = torch.arange(start, start + rows, device=device)[:, None]
    kp = torch.arange(lo, hi, device=device)[None, :]
    keep = torch.ones(rows, hi - lo, dtype=torch.bool, device=device)
    if is_causal:
        keep &= kp <= qp
    if window is not None:
        left, right = window
        if left is not None:
            keep &= kp >= qp - left
        if right is not None and not is_causal:
            keep &= kp <= qp + right
    if bounds:
        b = torch.tensor(bounds, device=device)
        keep &= torch.bucketize(qp, b, right=True) == torch.bucketize(kp, b, right=True)
    return keep


def _window(window) -> tuple[int | None, int | None] | None:
    if window is None or isinstance(window, tuple) and window == (None, None):
        return None
    if isinstance(window, int):
        return (window, window)
    left, right = window
    return (left, right)


def _check(q, k, v, world: int, load_balanced: bool, window, bounds, seq_len: int) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"cplib.allgather_sdpa: q, k, v must be (B, H, L, D), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[1] != v.shape[1] or q.shape[1] % k.shape[1]:
        raise ValueError(f"cplib.allgather_sdpa: k/v heads ({k.shape[1]}, {v.shape[1]}) must "
                         f"be equal and divide q's ({q.shape[1]})")
    if q.shape[2] != k.shape[2] or k.shape[2] != v.shape[2]:
        raise ValueError("cplib.allgather_sdpa: q, k and v must hold the same rows "
                         f"(got {q.shape[2]}, {k.shape[2]}, {v.shape[2]})")
    parts = 2 * world if load_balanced else world
    if seq_len % parts:
        raise ValueError(f"cplib.allgather_sdpa: the sequence ({seq_len}) must split into "
                         f"{parts} equal chunks")
    if window is not None and any(w is not None and w < 0 for w in window):
        raise ValueError(f"cplib.allgather_sdpa: window sides must be >= 0, got {window}")
    if bounds is not None and (bounds[0] != 0 or bounds[-1] != seq_len or
                               any(b >= c for b, c in zip(bounds, bounds[1:]))):
        raise ValueError(f"cplib.allgather_sdpa: cu_seqlens must rise strictly from 0 to "
                         f"{seq_len}, got {bounds}")


def allgather_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: GroupLike, *,
                   is_causal: bool = False, load_balanced: bool = False,
                   scale: float | None = None, cu_seqlens: torch.Tensor | list | None = None,
                   window=None) -> torch.Tensor:
    """This rank's attention output (B, Hq, L, Dv) over the whole sequence:
    K/V gathered once, one call per query chunk over the keys it can see
    (module doc). Differentiable in q, k and v; the backward reduce-scatters
    dK/dV. ``window``: ``w`` or ``(left, right)`` (``None`` a side without
    limit), in global positions; ``cu_seqlens``: global document bounds."""
    name = group_name_of(group)
    world = group_size(name)
    rank = torch.distributed.distributed_c10d._resolve_process_group(name).rank()
    seq_len = q.shape[2] * world
    win = _window(window)
    bounds = None if cu_seqlens is None else [int(x) for x in
                                              (cu_seqlens.tolist()
                                               if isinstance(cu_seqlens, torch.Tensor)
                                               else cu_seqlens)]
    _check(q, k, v, world, load_balanced, win, bounds, seq_len)
    kk, vv = _GatherKV.apply(k, v, name) if world > 1 else (k, v)
    order = _global_order(seq_len, world, load_balanced)
    if order is not None:
        order = order.to(k.device)
        kk, vv = kk.index_select(2, order), vv.index_select(2, order)
    gqa = q.shape[1] != k.shape[1]
    outs, at = [], 0
    for start, rows in query_chunks(seq_len, world, rank, load_balanced):
        qc = q.narrow(2, at, rows)
        at += rows
        lo, hi = visible_keys(start, rows, seq_len, is_causal, win, bounds)
        kc, vc = kk.narrow(2, lo, hi - lo), vv.narrow(2, lo, hi - lo)
        if win is None and not bounds:
            # causal: the prefix, bottom-right aligned (lo = 0); else every key
            mask = torch.nn.attention.bias.causal_lower_right(rows, hi - lo) \
                if is_causal else None
        else:
            mask = _mask(start, rows, lo, hi, is_causal, win, bounds, q.device)
        outs.append(F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, scale=scale,
                                                   enable_gqa=gqa))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
