"""Ulysses attention (DeepSpeed-Ulysses): an all-to-all trades each rank's
sequence shard for a head shard, every rank runs ordinary attention over the
whole sequence on its heads, and a second all-to-all trades back.

Fake kernels and autograd of the ``cplib_c::ulysses_*`` ops
(csrc/torch/ulysses/) and the Python entry points ``ulysses_reshard`` and
``ulysses_sdpa``; ``usp_sdpa`` (cplib/ulysses/usp.py) composes Ulysses with
the ring (USP). The checks are in cplib/ulysses/args.py.
"""

from __future__ import annotations

import torch

from ..attention.args import (acc_dtype, backend_arg, check_inputs, check_sinks, group_rank,
                              scale_arg)
from ..attention.autograd import attention_autograd
from ..comm.handshake import agreed
from ..comm.native import GroupLike, group_name_of, group_size, ops, reject_real_in_fake
from .args import (_BSHD, _SEQ_MAJOR, _check_local, _check_qkv, _degree, _local_sinks,
                   _reshard_shape, _to_seq, check_heads, exchange_to_heads)
from .usp import usp_attention

__all__ = ["ulysses_reshard", "ulysses_sdpa", "ulysses_attention"]


# ---------------------------------------------------------------- layout rules


def _strides(sizes: tuple[int, ...], order: tuple[int, ...]) -> tuple[int, ...]:
    """Strides of a dense tensor of ``sizes`` whose memory runs over dims ``order``
    (outermost first)."""
    strides = [0] * len(sizes)
    stride = 1
    for d in reversed(order):
        strides[d] = stride
        stride *= sizes[d]
    return tuple(strides)


# ---------------------------------------------------------------- reshard op


@torch.library.register_fake("cplib_c::ulysses_reshard")
def _reshard_fake(x, group_name, to_heads, head_repeat, lengths=None):
    reject_real_in_fake("ulysses_reshard", x)
    sizes, order = _reshard_shape("ulysses_reshard", x, group_size(group_name), to_heads,
                                  head_repeat, lengths, group_rank(group_name))
    return x.new_empty_strided(sizes, _strides(sizes, order))


# ulysses_reshard_covered (and ulysses_reshard_qkv_covered below): the same
# exchange without a handshake, for calls another op's handshake covers: the
# backward through autograd (covered by its forward's: one handshake per
# fwd+bwd) and the exchanges back inside ulysses_sdpa / usp_sdpa (covered by
# the exchange to heads of the same call).
torch.library.register_fake("cplib_c::ulysses_reshard_covered", _reshard_fake)


def _reshard_setup(ctx, inputs, output):
    _, ctx.group_name, ctx.to_heads, ctx.head_repeat, *rest = inputs
    ctx.lengths = rest[0] if rest else None


def _reshard_backward(ctx, grad):
    # The adjoint of an exchange is the exchange back; with repeated heads the
    # way back sums the copies of each head.
    return ops.ulysses_reshard_covered(grad, ctx.group_name, not ctx.to_heads, ctx.head_repeat,
                                       ctx.lengths), None, None, None, None


for _op in ("cplib_c::ulysses_reshard", "cplib_c::ulysses_reshard_covered"):
    torch.library.register_autograd(_op, _reshard_backward, setup_context=_reshard_setup)


@torch.library.register_fake("cplib_c::ulysses_reshard_qkv")
def _reshard_qkv_fake(q, k, v, group_name, to_heads, kv_head_repeat, lengths=None):
    n, rank = group_size(group_name), group_rank(group_name)
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
    dq, dk, dv = ops.ulysses_reshard_qkv_covered(*grads, ctx.group_name, not ctx.to_heads,
                                                 ctx.repeat, ctx.lengths)
    return dq, dk, dv, None, None, None, None


torch.library.register_fake("cplib_c::ulysses_reshard_qkv_covered", _reshard_qkv_fake)
for _op in ("cplib_c::ulysses_reshard_qkv", "cplib_c::ulysses_reshard_qkv_covered"):
    torch.library.register_autograd(_op, _reshard_qkv_backward,
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
    name = group_name_of(group)

    def check():
        check_inputs("ulysses_reshard", x=x)
        if isinstance(head_repeat, bool) or not isinstance(head_repeat, int):
            raise ValueError(f"cplib.ulysses_reshard: head_repeat must be an int, got "
                             f"{head_repeat!r}")
        return None if lengths is None else [int(n) for n in lengths]

    sizes = agreed("ulysses_reshard", name, (x,), check)
    return ops.ulysses_reshard(x, name, bool(to_heads), head_repeat, sizes)


# ---------------------------------------------------------------- local attention op


@torch.library.register_fake("cplib_c::ulysses_local_sdpa")
def _local_fake(q, k, v, is_causal, scale, backend, sinks=None):
    reject_real_in_fake("ulysses_local_sdpa", q, k, v, sinks)
    _check_local("ulysses_local_sdpa", q, k, v, is_causal, scale, backend)
    check_sinks("ulysses_local_sdpa", q, sinks)
    b, h, s, _ = q.shape
    sizes = (b, h, s, v.shape[3])
    out = q.new_empty_strided(sizes, _strides(sizes, _SEQ_MAJOR))
    lse = q.new_empty((b, h, s), dtype=acc_dtype(q.dtype))
    return out, lse


@torch.library.register_fake("cplib_c::ulysses_local_sdpa_backward")
def _local_backward_fake(grad_out, q, k, v, out, lse, is_causal, scale, backend):
    reject_real_in_fake("ulysses_local_sdpa_backward", grad_out, q, k, v, out, lse)
    _check_local("ulysses_local_sdpa_backward", q, k, v, is_causal, scale, backend)
    return tuple(t.new_empty_strided(t.shape, _strides(tuple(t.shape), _BSHD)) for t in (q, k, v))


_local_setup, _local_backward = attention_autograd(ops.ulysses_local_sdpa_backward,
                                                   ops.ulysses_local_sdpa)
torch.library.register_autograd("cplib_c::ulysses_local_sdpa", _local_backward,
                                setup_context=_local_setup)


# ---------------------------------------------------------------- entry points


# By the token of the default group (a new init makes a new one; see
# cplib/comm/native.py: group_token).
_self: dict[int, str] = {}


@torch.compiler.assume_constant_result
def _self_group() -> str:
    """A group of this process alone (made once per init, by this process
    only): the ring of one that runs pure Ulysses's masked attention."""
    import torch.distributed as dist

    from ..comm.native import group_token

    key = group_token(dist.distributed_c10d._get_default_group())
    if key not in _self:
        _self[key] = dist.new_group([dist.get_rank()], use_local_synchronization=True).group_name
    return _self[key]


def ulysses_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: GroupLike,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    backend: str | None = None,
    sinks: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    window: int | tuple[int | None, int | None] | None = None,
    seq_len: int | None = None,
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
    be split raise ValueError before any communication. v's head dim may
    differ from q/k's (MLA); ``sinks`` (Hq,) as in :func:`cplib.ring_sdpa`.

    ``cu_seqlens``, ``window`` and ``seq_len`` (any S >= N: rank r holds
    ``chunk_range(S, N, r)``) mean what they mean for
    :func:`cplib.ring_sdpa`; the attention over the whole sequence is then
    the ring's masked kernel on a ring of one rank.

    ``attn_mask``: a key-padding mask of this rank's keys (see
    :func:`cplib.ring_sdpa`), exchanged with the keys. Ranks may hold
    different lengths when not causal (learned in a handshake).
    """
    return ulysses_attention(q, k, v, group, is_causal, scale, backend, attn_mask, True, sinks,
                             cu_seqlens, window, seq_len)


def ulysses_attention(q, k, v, group: GroupLike, is_causal: bool, scale: float | None,
                      backend: str | None, attn_mask, need_lse: bool, sinks=None,
                      cu_seqlens=None, window=None, seq_len=None):
    """:func:`ulysses_sdpa`; without ``need_lse`` the lse is not exchanged
    back (None)."""
    op = "ulysses_sdpa"
    name = group_name_of(group)
    if attn_mask is not None:
        from ..attention.key_padding import key_padding_inputs

        # A mask rejected on one rank is rejected on every rank (the handshake).
        q, k, v, scale, _ = agreed(op, name, (q, k, v, attn_mask),
                                   lambda: key_padding_inputs(op, attn_mask, q, k, v, scale))
    if cu_seqlens is not None or window is not None or seq_len is not None:
        return usp_attention(q, k, v, name, _self_group(), is_causal, False, scale, "p2p",
                             backend, None, need_lse, sinks, cu_seqlens, window, seq_len)

    def args():
        _check_qkv(op, q, k, v)
        degree = _degree(name)
        check_heads(op, q.shape[1], k.shape[1], degree)
        scale_ = scale_arg(op, scale)
        code = backend_arg(op, backend)
        _check_local(op, q, k, v, is_causal, scale_, code)
        return degree, scale_, code, _local_sinks(op, q, sinks, name, degree)

    degree, scale, code, local_sinks = agreed(op, name, (q, k, v), args)
    lengths, (qh, kh, vh) = exchange_to_heads(op, q, k, v, name, degree, not is_causal)
    out_h, lse_h = ops.ulysses_local_sdpa(qh, kh, vh, bool(is_causal), scale, code, local_sinks)
    return _to_seq(out_h, lse_h, name, lengths, need_lse)
