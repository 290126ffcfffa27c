"""Ulysses attention (DeepSpeed-Ulysses): an all-to-all trades each rank's
sequence shard for a head shard, every rank runs ordinary attention over the
whole sequence on its heads, and a second all-to-all trades back.

Fake kernels and autograd of the ``cplib_c::ulysses_*`` ops
(csrc/torch/ulysses/) and the Python entry points ``ulysses_reshard`` and
``ulysses_sdpa``; ``usp_sdpa`` composes Ulysses with the ring (USP).
"""

from __future__ import annotations

import math

import torch

from ._native import GroupLike, group_name_of, group_size, ops
from ._ring import (
    BACKEND_CODES,
    ROTATE_CODES,
    _acc_dtype,
    _check,
    _group_rank,
    attention_autograd,
    ring_sdpa,
)

__all__ = ["ulysses_reshard", "ulysses_sdpa", "usp_sdpa", "kv_head_repeat", "check_heads",
           "ulysses_attention", "usp_attention"]


# ---------------------------------------------------------------- layout rules


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


@torch.compiler.assume_constant_result
def _degree(group_name: str) -> int:
    # The group's size, a constant of any compiled region (dynamo cannot trace
    # the name lookup itself).
    return group_size(group_name)


def _strides(sizes: tuple[int, ...], order: tuple[int, ...]) -> tuple[int, ...]:
    """Strides of a dense tensor of ``sizes`` whose memory runs over dims ``order``
    (outermost first)."""
    strides = [0] * len(sizes)
    stride = 1
    for d in reversed(order):
        strides[d] = stride
        stride *= sizes[d]
    return tuple(strides)


_SEQ_MAJOR = (2, 0, 1, 3)   # (S, B, H, D)
_HEAD_MAJOR = (1, 0, 2, 3)  # (H, B, S, D)
_BSHD = (0, 2, 1, 3)        # (B, S, H, D)


# ---------------------------------------------------------------- reshard op


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


@torch.library.register_fake("cplib_c::ulysses_reshard")
def _reshard_fake(x, group_name, to_heads, head_repeat, lengths=None):
    sizes, order = _reshard_shape("ulysses_reshard", x, group_size(group_name), to_heads,
                                  head_repeat, lengths, _group_rank(group_name))
    return x.new_empty_strided(sizes, _strides(sizes, order))


def _reshard_setup(ctx, inputs, output):
    _, ctx.group_name, ctx.to_heads, ctx.head_repeat, *rest = inputs
    ctx.lengths = rest[0] if rest else None


def _reshard_backward(ctx, grad):
    # The adjoint of an exchange is the exchange back; with repeated heads the
    # way back sums the copies of each head.
    return ops.ulysses_reshard(grad, ctx.group_name, not ctx.to_heads, ctx.head_repeat,
                               ctx.lengths), None, None, None, None


torch.library.register_autograd("cplib_c::ulysses_reshard", _reshard_backward,
                                setup_context=_reshard_setup)


@torch.library.register_fake("cplib_c::ulysses_reshard_qkv")
def _reshard_qkv_fake(q, k, v, group_name, to_heads, kv_head_repeat, lengths=None):
    n, rank = group_size(group_name), _group_rank(group_name)
    out = []
    for x, repeat in ((q, 1), (k, kv_head_repeat), (v, kv_head_repeat)):
        sizes, order = _reshard_shape("ulysses_reshard_qkv", x, n, to_heads, repeat, lengths,
                                      rank)
        out.append(x.new_empty_strided(sizes, _strides(sizes, order)))
    return tuple(out)


def _reshard_qkv_setup(ctx, inputs, output):
    _, _, _, ctx.group_name, ctx.to_heads, ctx.repeat, *rest = inputs
    ctx.lengths = rest[0] if rest else None
    ctx.outputs = [(o.shape, o.dtype, o.device) for o in output]


def _reshard_qkv_backward(ctx, gq, gk, gv):
    # An output without a gradient still takes part in the exchange back.
    grads = [torch.zeros(shape, dtype=dtype, device=device) if g is None else g
             for g, (shape, dtype, device) in zip((gq, gk, gv), ctx.outputs)]
    dq, dk, dv = ops.ulysses_reshard_qkv(*grads, ctx.group_name, not ctx.to_heads, ctx.repeat,
                                         ctx.lengths)
    return dq, dk, dv, None, None, None, None


torch.library.register_autograd("cplib_c::ulysses_reshard_qkv", _reshard_qkv_backward,
                                setup_context=_reshard_qkv_setup)


def ulysses_reshard(x: torch.Tensor, group: GroupLike, *, to_heads: bool,
                    head_repeat: int = 1, lengths: list[int] | None = None) -> torch.Tensor:
    """Re-shards ``x`` over ``group`` (N ranks), differentiably.

    ``to_heads=True``: ``x`` (B, H, S/N, D) is this rank's sequence shard (rank
    order); returns (B, H*head_repeat/N, S, D), this rank's heads over the
    whole sequence. ``to_heads=False`` is the inverse (with ``head_repeat > 1``
    it sums the repeated copies of each head). ``head_repeat > 1`` only brings
    fewer heads than ranks to one head per rank (H*head_repeat == N).
    The result is a fresh tensor in the order the exchange delivers it:
    sequence-major strides for ``to_heads``, head-major otherwise.
    ``lengths`` (every rank's sequence length, rank order) lets the ranks
    hold different lengths; S is then their sum.
    """
    return ops.ulysses_reshard(x, group_name_of(group), bool(to_heads), int(head_repeat),
                               None if lengths is None else [int(n) for n in lengths])


# ---------------------------------------------------------------- local attention op


def _check_local(op: str, q, k, v, is_causal, scale, backend) -> None:
    # ring_sdpa's checks minus the ring's (rotation, load balance, group).
    _check(op, q, k, v, None, is_causal, False, scale, backend, 0)


@torch.library.register_fake("cplib_c::ulysses_local_sdpa")
def _local_fake(q, k, v, is_causal, scale, backend):
    _check_local("ulysses_local_sdpa", q, k, v, is_causal, scale, backend)
    b, h, s, _ = q.shape
    sizes = (b, h, s, v.shape[3])
    out = q.new_empty_strided(sizes, _strides(sizes, _SEQ_MAJOR))
    lse = q.new_empty((b, h, s), dtype=_acc_dtype(q.dtype))
    return out, lse


@torch.library.register_fake("cplib_c::ulysses_local_sdpa_backward")
def _local_backward_fake(grad_out, q, k, v, out, lse, is_causal, scale, backend):
    _check_local("ulysses_local_sdpa_backward", q, k, v, is_causal, scale, backend)
    return tuple(t.new_empty_strided(t.shape, _strides(tuple(t.shape), _BSHD)) for t in (q, k, v))


_local_setup, _local_backward = attention_autograd(ops.ulysses_local_sdpa_backward)
torch.library.register_autograd("cplib_c::ulysses_local_sdpa", _local_backward,
                                setup_context=_local_setup)


# ---------------------------------------------------------------- entry points


def _backend_code(op: str, backend: str | None) -> int:
    if backend not in BACKEND_CODES:
        raise ValueError(f"cplib.{op}: backend={backend!r} is not one of None, 'auto', 'flash', "
                         "'efficient', 'cudnn'")
    return BACKEND_CODES[backend]


def _check_scale(op: str, scale: float | None) -> float | None:
    if scale is None:
        return None
    scale = float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"cplib.{op}: scale={scale} must be a finite positive number or None")
    return scale


def _check_qkv(op: str, q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"cplib.{op}: expected q, k, v of shape (B, H, S_local, D); {name} "
                             f"is {shape}")


def gather_local_lengths(op: str, q: torch.Tensor, k: torch.Tensor, group_name: str,
                         degree: int, is_causal: bool) -> list[int] | None:
    """Every rank's local length (one small all-gather), or None when they
    are equal (the even layout). Ranks of different lengths (joint text+image
    shards) work for non-causal attention; causal attention raises ValueError
    naming the lengths, on every rank alike. While compiling, the lengths are
    taken to be equal (a traced graph cannot depend on exchanged values)."""
    if degree == 1 or torch.compiler.is_compiling():
        return None
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"cplib.{op}: q has {q.shape[2]} rows but k/v {k.shape[2]}; Ulysses "
                         "needs one local length for q and k/v")
    lengths = list(ops.gather_local_lengths([q.shape[2]], group_name, q.device))
    if len(set(lengths)) == 1:
        return None
    if is_causal:
        raise ValueError(f"cplib.{op}: the ranks' local lengths differ ({lengths}), which only "
                         "non-causal attention accepts (a causal mask needs global positions)")
    return lengths


def _to_heads(q, k, v, group_name: str, degree: int, lengths=None):
    # One op for the three exchanges, all in flight at once.
    return ops.ulysses_reshard_qkv(q, k, v, group_name, True, kv_head_repeat(k.shape[1], degree),
                                   lengths)


def _to_seq(out_h, lse_h, group_name: str, lengths=None, need_lse: bool = True):
    out = ops.ulysses_reshard(out_h, group_name, False, 1, lengths)
    if not need_lse:  # SDPA inside a context discards it: one exchange fewer
        return out, None
    # lse as ring_sdpa returns it: contiguous (B, H, S_local), not differentiable.
    lse = ops.ulysses_reshard(lse_h.unsqueeze(-1), group_name, False, 1, lengths).squeeze(-1)
    return out, lse.contiguous()


def ulysses_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: GroupLike,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    backend: str | None = None,
    attn_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ulysses attention of the local sequence shards ``q`` (B, Hq, S/N, D) and
    ``k``/``v`` (B, Hkv, S/N, D), in rank order, over ``group`` (a ProcessGroup
    or its name, N ranks).

    Returns ``(out, lse)`` as :func:`cplib.ring_sdpa` does: ``out`` (B, Hq, S/N,
    D_v) in q's dtype, ``lse`` (B, Hq, S/N) contiguous, float32 (float64 for
    float64 inputs). Differentiable in q, k and v (not through ``lse``).
    Hq must be a multiple of N; K/V heads either split over N or, when fewer
    than N, are repeated to one head per rank (never to Hq). Heads that cannot
    be split raise ValueError before any communication. ``attn_mask``: a
    key-padding mask of this rank's keys (see :func:`cplib.ring_sdpa`),
    exchanged with the keys. Ranks may hold different lengths when not causal
    (one small all-gather learns them).
    """
    return ulysses_attention(q, k, v, group, is_causal, scale, backend, attn_mask, True)


def ulysses_attention(q, k, v, group: GroupLike, is_causal: bool, scale: float | None,
                      backend: str | None, attn_mask, need_lse: bool):
    """:func:`ulysses_sdpa`; without ``need_lse`` the lse is not exchanged
    back (None)."""
    op = "ulysses_sdpa"
    if attn_mask is not None:
        from ._key_padding import key_padding_inputs

        _check_qkv(op, q, k, v)
        q, k, v, scale, dv = key_padding_inputs(op, attn_mask, q, k, v, scale)
        out, lse = ulysses_attention(q, k, v, group, is_causal, scale, backend, None, need_lse)
        return out[..., :dv], lse
    _check_qkv(op, q, k, v)
    name = group_name_of(group)
    degree = _degree(name)
    check_heads(op, q.shape[1], k.shape[1], degree)
    scale = _check_scale(op, scale)
    code = _backend_code(op, backend)
    _check_local(op, q, k, v, is_causal, scale, code)
    lengths = gather_local_lengths(op, q, k, name, degree, is_causal)
    qh, kh, vh = _to_heads(q, k, v, name, degree, lengths)
    out_h, lse_h = ops.ulysses_local_sdpa(qh, kh, vh, bool(is_causal), scale, code)
    return _to_seq(out_h, lse_h, name, lengths, need_lse)


def usp_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ulysses_group: GroupLike,
    ring_group: GroupLike,
    *,
    is_causal: bool = False,
    load_balanced: bool = False,
    scale: float | None = None,
    rotate: str = "p2p",
    backend: str | None = None,
    attn_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """USP: Ulysses over ``ulysses_group`` (U ranks) around ring attention over
    ``ring_group`` (R ranks). The shards are this rank's part of the layout
    that :mod:`cplib._usp` defines: the ring shard of this rank's Ulysses group
    (head-tail over the R ring positions with ``load_balanced``), cut into U
    pieces in Ulysses-rank order. Same returns and errors as
    :func:`ulysses_sdpa`, plus ring_sdpa's (``rotate``, ``load_balanced``),
    and ``attn_mask`` as there."""
    return usp_attention(q, k, v, ulysses_group, ring_group, is_causal, load_balanced, scale,
                         rotate, backend, attn_mask, True)


def usp_attention(q, k, v, ulysses_group: GroupLike, ring_group: GroupLike, is_causal: bool,
                  load_balanced: bool, scale: float | None, rotate: str, backend: str | None,
                  attn_mask, need_lse: bool):
    """:func:`usp_sdpa`; without ``need_lse`` the lse is not exchanged back
    (None)."""
    op = "usp_sdpa"
    if attn_mask is not None:
        from ._key_padding import key_padding_inputs

        _check_qkv(op, q, k, v)
        q, k, v, scale, dv = key_padding_inputs(op, attn_mask, q, k, v, scale)
        out, lse = usp_attention(q, k, v, ulysses_group, ring_group, is_causal, load_balanced,
                                 scale, rotate, backend, None, need_lse)
        return out[..., :dv], lse
    _check_qkv(op, q, k, v)
    uname, rname = group_name_of(ulysses_group), group_name_of(ring_group)
    degree = _degree(uname)
    check_heads(op, q.shape[1], k.shape[1], degree)
    if rotate not in ROTATE_CODES:
        raise ValueError(f"cplib.{op}: rotate={rotate!r} is not one of {sorted(ROTATE_CODES)}")
    scale = _check_scale(op, scale)
    code = _backend_code(op, backend)
    _check_local(op, q, k, v, is_causal, scale, code)
    if load_balanced and (q.shape[2] * degree) % 2:
        raise ValueError(f"cplib.{op}: load_balanced needs an even ring shard, got "
                         f"{q.shape[2]} x {degree} rows")
    _degree(rname)  # ValueError for an unknown ring group, before any exchange
    lengths = gather_local_lengths(op, q, k, uname, degree, is_causal)
    qh, kh, vh = _to_heads(q, k, v, uname, degree, lengths)
    # The ring learns its ranks' lengths itself (ring_sdpa without seq_len).
    out_h, lse_h = ring_sdpa(qh, kh, vh, rname, is_causal=is_causal, load_balanced=load_balanced,
                             scale=scale, rotate=rotate, backend=backend)
    return _to_seq(out_h, lse_h, uname, lengths, need_lse)
