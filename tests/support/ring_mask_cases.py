"""Helpers of the documents / windows / any-length ring tests: the fp64
reference with an explicit boolean mask over the whole sequence, the shard
of a global tensor in cplib's layout for any length, and one checked run of
``cplib.ring_sdpa``."""

from __future__ import annotations

import torch
import torch.distributed as dist

import cplib
from cplib.attention.layout import shard_positions
from harness import assert_close
from ring_cases import global_tensor


def visible(s: int, *, causal: bool, cu_seqlens=None, window=None) -> torch.Tensor:
    """(S, S) boolean: query i sees key j."""
    pos = torch.arange(s)
    return visible_at(pos, pos, causal=causal, cu_seqlens=cu_seqlens, window=window)


def visible_at(q_pos: torch.Tensor, kv_pos: torch.Tensor, *, causal: bool, window=None,
               cu_seqlens=None) -> torch.Tensor:
    """(Lq, Lk) boolean over global positions: the query at q_pos[i] sees the
    key at kv_pos[j] (causal, window (left, right) or w, documents)."""
    i, j = q_pos.view(-1, 1), kv_pos.view(1, -1)
    m = torch.ones(i.shape[0], j.shape[1], dtype=torch.bool)
    if causal:
        m &= j <= i
    if window is not None:
        left, right = (window, window) if isinstance(window, int) else window
        if left is not None:
            m &= j >= i - left
        if right is not None:
            m &= j <= i + right
    if cu_seqlens is not None:
        bounds = torch.as_tensor(cu_seqlens)[1:]
        m &= torch.bucketize(i, bounds, right=True) == torch.bucketize(j, bounds, right=True)
    return m


def masked_reference(q, k, v, cot, mask: torch.Tensor, scale=None):
    """fp64 (out, lse, dq, dk, dv) of attention with an explicit mask."""
    q, k, v = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    kx, vx = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ kx.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    out = torch.softmax(scores, -1) @ vx
    out.backward(cot.double())
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def placement_positions(cu_seqlens, rank: int, n: int) -> torch.Tensor:
    """The global positions of ``rank``'s rows under the document placement."""
    pieces = cplib.DocumentPlacementLoadBalancer(cu_seqlens, n, "cpu").pieces()[rank]
    return torch.cat([torch.arange(a, a + m) for a, m in pieces])


def local(t: torch.Tensor, s: int, lb: bool, documents=None, placement=None) -> torch.Tensor:
    """This rank's rows of dim 2 in cplib's layout (any length; per document
    when ``documents`` is given; the document placement of ``placement``,
    cu_seqlens, when given)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    if placement is not None:
        return t[:, :, placement_positions(placement, rank, n)].clone()
    return t[:, :, shard_positions(s, n, rank, lb, documents=documents)].clone()


def random_documents(s: int, gen: torch.Generator, count: int) -> list[int]:
    """cu_seqlens with `count` documents of random lengths (some of length 1)."""
    count = max(1, min(count, s))
    cuts = torch.randperm(s - 1, generator=gen)[:count - 1] + 1
    return [0] + sorted(cuts.tolist()) + [s]


def check_ring(s: int, *, causal: bool, lb: bool, rotate: str, cu_seqlens=None, window=None,
               b=1, hq=2, hkv=1, d=8, dtype=torch.float64, seed=0, seq_len_arg=True,
               tol=1e-10, what="", per_document=False, placement=False) -> None:
    """One ring_sdpa call against the masked fp64 reference: out, lse and the
    gradients of q, k, v of this rank's rows."""
    q = global_tensor((b, hq, s, d), dtype, seed)
    k = global_tensor((b, hkv, s, d), dtype, seed + 1)
    v = global_tensor((b, hkv, s, d), dtype, seed + 2)
    cot = global_tensor((b, hq, s, d), dtype, seed + 3)
    mask = visible(s, causal=causal, cu_seqlens=cu_seqlens, window=window)
    ref = masked_reference(q, k, v, cot, mask)
    docs = cu_seqlens if per_document else None
    placed = cu_seqlens if placement else None
    ql, kl, vl = (local(t, s, lb, docs, placed).requires_grad_(True) for t in (q, k, v))
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=torch.int32)
    out, lse = cplib.ring_sdpa(ql, kl, vl, dist.group.WORLD, is_causal=causal, load_balanced=lb,
                               rotate=rotate, cu_seqlens=cu, window=window,
                               seq_len=s if seq_len_arg else None, per_document=per_document,
                               placement=placement)
    out.backward(local(cot, s, lb, docs, placed))
    docs_said = cu_seqlens if cu_seqlens is None or len(cu_seqlens) < 12 else len(cu_seqlens) - 1
    what = (f"S={s} n={dist.get_world_size()} causal={causal} lb={lb} {rotate} docs={docs_said} "
            f"window={window} per_document={per_document} placement={placement} {what}")
    assert out.shape == ql.shape and out.is_contiguous()
    for name, got, want in (("out", out, ref[0]), ("lse", lse, ref[1]), ("dq", ql.grad, ref[2]),
                            ("dk", kl.grad, ref[3]), ("dv", vl.grad, ref[4])):
        assert not torch.isnan(got).any(), f"{name} has NaN [{what}]"
        assert_close(got.double(), local(want, s, lb, docs, placed), atol=tol, rtol=tol,
                     what=f"{name} [{what}]")
