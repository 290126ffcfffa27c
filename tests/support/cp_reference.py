"""A slow, obviously-correct stand-in for ``cplib.ring.op.ring_sdpa`` and
``ring_attention`` (same signatures; the front end's routed SDPA calls take
``ring_attention`` with the call's record): all-gather K/V with cplib's
differentiable all-gather, then masked attention of the local queries against
the whole sequence, the causal mask built from the global positions of the
shard layout. Tests use it to check the front end (sharding, layout flags,
dispatch, gradients) independently of the native ring; ``use_ring("native")``
selects the real op."""

from __future__ import annotations

import sys
import types

import torch
import torch.distributed as dist

import cplib
from cplib.ring.load_balancer import head_tail_indices
from cplib.comm.native import group_name_of

CALLS: list[dict] = []
_saved_native: list = []


def _positions(rank: int, n: int, s_local: int, load_balanced: bool) -> torch.Tensor:
    if load_balanced:
        return head_tail_indices(s_local * n, n).view(n, s_local)[rank]
    return torch.arange(rank * s_local, (rank + 1) * s_local)


def reference_ring_sdpa(q, k, v, group, *, is_causal=False, load_balanced=False, scale=None,
                        rotate="p2p", backend=None):
    name = group_name_of(group)
    CALLS.append(dict(shape=tuple(q.shape), kv_heads=k.shape[1], group=name, is_causal=is_causal,
                      load_balanced=load_balanced, scale=scale, rotate=rotate, backend=backend))
    rank, n = dist.get_rank(), dist.get_world_size()  # the tests' groups span the world
    k_all, v_all = cplib.flex_cp_allgather(k.contiguous(), v.contiguous(), 2, name)
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k_all, v_all = k_all.repeat_interleave(rep, 1), v_all.repeat_interleave(rep, 1)
    s = q.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = (q @ k_all.transpose(-1, -2)).to(acc) * scale
    if is_causal:
        qpos = _positions(rank, n, s, load_balanced)
        kpos = torch.cat([_positions(r, n, s, load_balanced) for r in range(n)])
        scores = scores.masked_fill(qpos[:, None] < kpos[None, :], float("-inf"))
    lse = torch.logsumexp(scores, -1)
    out = (torch.softmax(scores, -1).to(v_all.dtype) @ v_all)
    return out.to(q.dtype), lse


def reference_ring_attention(q, k, v, call, *, sinks=None, attn_mask=None):
    """``ring_attention`` of a call the stand-in computes (no documents,
    windows, uneven lengths, masks or sinks), recorded as ``ring_sdpa``'s
    keywords."""
    unsupported = dict(cu_seqlens=call.cu_seqlens, window=call.window, seq_len=call.seq_len,
                       sinks=sinks, attn_mask=attn_mask)
    assert all(x is None for x in unsupported.values()), unsupported
    assert call.layout in ("sequential", "head_tail"), call.layout
    return reference_ring_sdpa(q, k, v, call.group_name, is_causal=call.is_causal,
                               load_balanced=call.layout == "head_tail", scale=call.scale,
                               rotate=call.rotate,
                               backend=None if call.backend == "auto" else call.backend)


def use_ring(impl: str) -> None:
    """Selects what ``cplib.ring.op`` is for this process: the native ring op
    ("native", must be importable) or the reference above ("reference")."""
    current = sys.modules.get("cplib.ring.op")
    if current is not None and getattr(current, "ring_sdpa", None) is not reference_ring_sdpa:
        _saved_native[:] = [current]  # never import the native module twice
    if impl == "reference":
        # The native module's argument helpers stay (other modules import
        # them from it); only the ring op is replaced.
        import cplib.ring.op  # noqa: F401  (loaded: sys.modules now has it)
        native = _saved_native[0] if _saved_native else sys.modules["cplib.ring.op"]
        mod = types.ModuleType("cplib.ring.op")
        mod.__dict__.update({k: v for k, v in vars(native).items() if not k.startswith("__")})
        mod.ring_sdpa = reference_ring_sdpa
        mod.ring_attention = reference_ring_attention
        sys.modules["cplib.ring.op"] = mod
    elif impl == "native":
        if _saved_native:
            sys.modules["cplib.ring.op"] = _saved_native[0]
        else:
            sys.modules.pop("cplib.ring.op", None)
            import cplib.ring.op  # noqa: F401  (fails loudly if the ring op is missing)
    else:
        raise ValueError(impl)
    CALLS.clear()


def restore_native_ring() -> None:
    """Puts the native ring back if the reference is installed (the test
    harness calls it after every task on its pooled ranks)."""
    current = sys.modules.get("cplib.ring.op")
    if current is not None and getattr(current, "ring_sdpa", None) is reference_ring_sdpa:
        use_ring("native")
