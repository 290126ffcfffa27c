"""What Ulysses and USP share below their entry points: the checks (the
same as csrc/torch/ulysses/'s, before dispatch: head counts against the
Ulysses degree, the shapes of a reshard, q/k/v, every rank's length when
joint shards differ) and the exchanges to heads and back."""

from __future__ import annotations

import torch

from ..attention.args import check_inputs, check_sinks, group_rank
from ..comm.handshake import can_handshake, handshake
from ..comm.native import group_size, ops
from ..ring.call import RingCall
from ..ring.check import check_call

__all__ = ["check_heads", "kv_head_repeat", "exchange_to_heads"]

_SEQ_MAJOR = (2, 0, 1, 3)   # (S, B, H, D)
_HEAD_MAJOR = (1, 0, 2, 3)  # (H, B, S, D)
_BSHD = (0, 2, 1, 3)        # (B, S, H, D)


def check_heads(op: str, hq: int, hkv: int, degree: int) -> None:
    """ValueError (from shapes alone, so on every rank alike) unless ``hq``
    query heads and ``hkv`` key/value heads can be split over ``degree``
    Ulysses ranks."""
    if degree < 1:
        raise ValueError(f"cplib.{op}: the Ulysses degree must be >= 1, got {degree}")
    if hkv < 1 or hq % hkv:
        raise ValueError(f"cplib.{op}: q has {hq} heads, which is not a multiple of k/v's "
                         f"{hkv} heads")
    if hq % degree:
        raise ValueError(f"cplib.{op}: {hq} query heads cannot be split over the Ulysses "
                         f"degree {degree} (the head count must be a multiple of it)")
    if hkv % degree and degree % hkv:
        raise ValueError(f"cplib.{op}: {hkv} key/value heads cannot be split over the Ulysses "
                         f"degree {degree} (the degree must divide the head count or be a "
                         "multiple of it)")


def kv_head_repeat(hkv: int, degree: int) -> int:
    """How often each K/V head is repeated for the exchange: 1 when the heads
    split evenly, else up to one head per rank (never up to q's heads)."""
    return 1 if hkv % degree == 0 else degree // hkv


def _reshard_shape(op: str, x: torch.Tensor, n: int, to_heads: bool, repeat: int,
                   lengths=None, rank: int | None = None) -> tuple:
    # Mirrors check() in csrc/torch/ulysses/ulysses_reshard.cpp.
    direction = "seq -> heads" if to_heads else "heads -> seq"
    if x.dim() != 4:
        raise ValueError(f"cplib.{op} ({direction}): expected a (B, H, S, D) tensor, got shape "
                         f"{tuple(x.shape)}")
    if x.device.type not in ("cpu", "cuda", "meta"):
        raise ValueError(f"cplib.{op} ({direction}): unsupported device {x.device}")
    if repeat < 1:
        raise ValueError(f"cplib.{op} ({direction}): head_repeat={repeat} must be >= 1")
    b, h, s, d = x.shape
    if lengths is not None:
        lengths = list(lengths)
        if len(lengths) != n:
            raise ValueError(f"cplib.{op} ({direction}): lengths has {len(lengths)} entries for "
                             f"{n} ranks")
        if any(length <= 0 for length in lengths):
            raise ValueError(f"cplib.{op} ({direction}): lengths must be positive, got "
                             f"{lengths}")
        if not to_heads and sum(lengths) != s:
            raise ValueError(f"cplib.{op} ({direction}): lengths sum to {sum(lengths)} but the "
                             f"sequence has {s} rows")
    if to_heads:
        if (h * repeat) % n:
            rep = f" (repeated {repeat}x)" if repeat > 1 else ""
            raise ValueError(f"cplib.{op} ({direction}): {h} heads{rep} cannot be split over "
                             f"the Ulysses degree {n}")
        if repeat != 1 and h * repeat != n:
            raise ValueError(f"cplib.{op} ({direction}): head_repeat={repeat} must bring the "
                             f"{h} heads to exactly the Ulysses degree {n}")
        if lengths is not None and rank is not None and lengths[rank] != s:
            raise ValueError(f"cplib.{op} ({direction}): lengths[{rank}] = {lengths[rank]} but "
                             f"this rank holds {s} rows")
        total = s * n if lengths is None else sum(lengths)
        return (b, h * repeat // n, total, d), _SEQ_MAJOR
    if lengths is None and s % n:
        raise ValueError(f"cplib.{op} ({direction}): sequence length {s} cannot be split over "
                         f"the Ulysses degree {n}")
    if repeat != 1 and (h != 1 or n % repeat):
        raise ValueError(f"cplib.{op} ({direction}): head_repeat={repeat} needs one head per "
                         f"rank (got {h}) and to divide the Ulysses degree {n}")
    local = s // n if lengths is None else lengths[rank]
    return (b, h * n // repeat, local, d), _HEAD_MAJOR


def _check_qkv(op: str, q, k, v) -> None:
    check_inputs(op, q=q, k=k, v=v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"cplib.{op}: expected q, k, v of shape (B, H, S_local, D); {name} "
                             f"is {shape}")


def exchange_to_heads(op: str, q, k, v, name: str, degree: int, may_differ: bool):
    """``(lengths, (qh, kh, vh))``: the exchange of q, k and v to heads over
    the Ulysses group, with one handshake in all. With ``may_differ``
    (non-causal attention without a layout), ranks may hold different
    lengths (joint text+image shards): every
    rank's q and k/v lengths are learned in the handshake that also
    describes the exchange (shapes but the sequence dim, dtypes, devices),
    and the exchange then runs without one of its own
    (``ulysses_reshard_qkv_covered``; its checks cannot fail on one rank
    alone: the wrapper's ran before this handshake, and the lengths are the
    same table on every rank). ``lengths`` is None when every rank holds
    the same. Otherwise (causal: a causal mask needs global positions), and
    for traces and meta tensors, the exchange's own handshake compares the
    lengths. While compiling, lengths are taken to be equal (a traced graph
    cannot depend on exchanged values)."""
    repeat = kv_head_repeat(k.shape[1], degree)
    from torch._subclasses.fake_tensor import is_fake
    if (degree == 1 or not may_differ or torch.compiler.is_compiling()
            or q.device.type == "meta" or is_fake(q)):
        return None, ops.ulysses_reshard_qkv(q, k, v, name, True, repeat, None)
    mine = [q.shape[2], k.shape[2]]
    if can_handshake(name):
        table = handshake(name, op, {"q": q, "k": k, "v": v},
                          {"kv_head_repeat": repeat, "to_heads": 1}, lengths=mine, skip_dim=2)
    else:
        flat = list(ops.gather_local_lengths(mine, name, q.device))
        table = [flat[2 * r:2 * r + 2] for r in range(len(flat) // 2)]
    lq, lk = [row[0] for row in table], [row[1] for row in table]
    if len(set(lq)) == 1 and len(set(lk)) == 1:
        lengths = None
    elif lq != lk:
        # The same table on every rank: every rank raises this.
        raise ValueError(f"cplib.{op}: the ranks' local lengths differ (q {lq}, k/v {lk}); "
                         "ranks of different lengths need q and k/v of one length each")
    else:
        lengths = lq
    return lengths, ops.ulysses_reshard_qkv_covered(q, k, v, name, True, repeat, lengths)


@torch.compiler.assume_constant_result
def _degree(group_name: str) -> int:
    # The group's size, a constant of any compiled region (dynamo cannot trace
    # the name lookup itself).
    return group_size(group_name)


def _check_local(op: str, q, k, v, is_causal, scale, backend) -> None:
    # ring_sdpa's checks minus the ring's (rotation, load balance, group).
    check_call(op, q, k, v, RingCall(None, bool(is_causal), scale=scale, backend=backend))


@torch.compiler.assume_constant_result
def _rank_in(group_name: str) -> int:
    # This process's rank in the group, a constant of any compiled region.
    return group_rank(group_name)


def _local_sinks(op: str, q, sinks, group_name: str, degree: int):
    """The sinks of this rank's heads after the exchange to heads (rank r of
    the Ulysses group holds q heads [r Hq/U, (r+1) Hq/U)); differentiable."""
    if sinks is None:
        return None
    check_sinks(op, q, sinks)
    h = q.shape[1] // degree
    return sinks.narrow(0, _rank_in(group_name) * h, h)


def _to_seq(out_h, lse_h, group_name: str, lengths=None, need_lse: bool = True):
    # Covered by the same call's exchange to heads: no handshake of their own.
    out = ops.ulysses_reshard_covered(out_h, group_name, False, 1, lengths)
    if not need_lse:  # SDPA inside a context discards it: one exchange fewer
        return out, None
    # lse as ring_sdpa returns it: contiguous (B, H, S_local), not differentiable.
    lse = ops.ulysses_reshard_covered(lse_h.unsqueeze(-1), group_name, False, 1,
                                      lengths).squeeze(-1)
    return out, lse.contiguous()
