"""Fake kernels and autograd for ``cplib_c::ring_sdpa`` (ring attention over a
process group, implemented in C++: csrc/torch/ring/) and its Python
entry point ``ring_sdpa``. The argument checks are in cplib/ring/args.py."""

from __future__ import annotations

import logging
import math
from typing import Literal

import torch

from ..comm.handshake import agreed
from ..comm.native import GroupLike, group_name_of, group_size, ops, reject_real_in_fake
from .args import (_DTYPES, RING_PASS_CODES, ROTATE_CODES, _acc_dtype,
                   _check_extras, _check_positions, _is_fake, backend_arg, check_inputs,
                   check_sinks, int_arg, rotate_arg, scale_arg, window_arg)

__all__ = ["ring_sdpa", "ring_pass_auto"]

log = logging.getLogger("cplib")


def _check(op: str, q, k, v, group_name: str, is_causal: bool, load_balanced: bool,
           scale: float | None, backend: int, rotate: int, cu_seqlens=None, window=None,
           seq_len=None, per_document=False, q_positions=None, kv_positions=None,
           ring_pass: int = 0) -> None:
    # Mirrors check_args in csrc/torch/ring/ring_args.cpp so traced code fails the same way.
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"cplib.{op}: expected q, k, v of shape (B, H, S_local, D), got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"cplib.{op}: q, k, v must be on one device, got {q.device}, "
                         f"{k.device}, {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"cplib.{op}: q, k, v must have one dtype, got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")
    if q.dtype not in _DTYPES:
        raise ValueError(f"cplib.{op}: unsupported dtype {q.dtype} "
                         "(expected float32, float64, bfloat16 or float16)")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"cplib.{op}: batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, "
                         f"v {v.shape[0]}")
    if q.shape[0] == 0:
        raise ValueError(f"cplib.{op}: empty batch (q has shape {tuple(q.shape)})")
    if k.shape[1:3] != v.shape[1:3]:
        raise ValueError(f"cplib.{op}: k {tuple(k.shape)} and v {tuple(v.shape)} must agree in "
                         "heads and length")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"cplib.{op}: q head dim {q.shape[3]} differs from k head dim "
                         f"{k.shape[3]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"cplib.{op}: q has {q.shape[1]} heads, which is not a multiple of "
                         f"k/v's {k.shape[1]} heads")
    positions = q_positions is not None or kv_positions is not None
    if (q.shape[2] == 0 or k.shape[2] == 0) and not positions:
        raise ValueError(f"cplib.{op}: empty local sequence (q length {q.shape[2]}, kv length "
                         f"{k.shape[2]})")
    if q.shape[3] == 0 or v.shape[3] == 0:
        raise ValueError(f"cplib.{op}: empty head dim")
    if q.device.type not in ("cuda", "cpu", "meta"):
        raise ValueError(f"cplib.{op}: unsupported device {q.device}")
    if rotate not in ROTATE_CODES.values():
        raise ValueError(f"cplib.{op}: rotate={rotate} is not a rotation "
                         "(0 = p2p, 1 = alltoall, 2 = allgather)")
    if backend not in (-1, 1, 2, 3):
        raise ValueError(f"cplib.{op}: backend={backend} is not a backend "
                         "(-1 = auto, 1 = flash, 2 = efficient, 3 = cudnn)")
    if q.device.type != "cuda" and backend not in (-1, 1):
        raise ValueError(f"cplib.{op}: backend={backend} needs CUDA; CPU tensors always use "
                         "flash (1)")
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"cplib.{op}: scale={scale} must be a finite positive number or None")
    if ring_pass not in RING_PASS_CODES.values():
        raise ValueError(f"cplib.{op}: ring_pass={ring_pass} is not a ring pass "
                         "(0 = kv, 1 = q, 2 = auto)")
    if positions:
        _check_positions(op, "q_positions", q_positions, q.shape[2], "q")
        _check_positions(op, "kv_positions", kv_positions, k.shape[2], "k/v")
        if load_balanced or seq_len is not None or per_document:
            raise ValueError(f"cplib.{op}: q_positions/kv_positions describe the layout "
                             "themselves: they exclude load_balanced, seq_len and per_document")
        if group_name is not None:
            group_size(group_name)
        if window is not None and len(list(window)) != 2:
            raise ValueError(f"cplib.{op}: window must be (left, right), got {list(window)}")
        if window is not None and min(window) < 0:
            raise ValueError(f"cplib.{op}: window={list(window)} must be non-negative "
                             "(None for no limit)")
        return
    if is_causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"cplib.{op}: is_causal needs equal local q and kv lengths, got q "
                         f"{q.shape[2]} and kv {k.shape[2]}")
    if seq_len is None and not per_document and load_balanced and (q.shape[2] % 2 or
                                                                   k.shape[2] % 2):
        raise ValueError(f"cplib.{op}: load_balanced needs even local lengths (two chunks per "
                         f"rank), got q {q.shape[2]} and kv {k.shape[2]}")
    if group_name is None:  # a world-of-one check (cplib/ulysses/args.py)
        return
    group_size(group_name)  # ValueError for an unknown group
    _check_extras(op, q, k, group_name, load_balanced, cu_seqlens, window, seq_len, per_document)


@torch.library.register_fake("cplib_c::ring_sdpa")
def _ring_sdpa_fake(q, k, v, group_name, is_causal, load_balanced, scale, backend, rotate,
                    cu_seqlens=None, window=None, seq_len=None, per_document=False, sinks=None,
                    q_positions=None, kv_positions=None, ring_pass=0):
    reject_real_in_fake("ring_sdpa", q, k, v, cu_seqlens, sinks, q_positions, kv_positions)
    _check("ring_sdpa", q, k, v, group_name, is_causal, load_balanced, scale, backend, rotate,
           cu_seqlens, window, seq_len, per_document, q_positions, kv_positions, ring_pass)
    check_sinks("ring_sdpa", q, sinks)
    b, h, s, _ = q.shape
    out = q.new_empty((b, h, s, v.shape[3]))
    lse = q.new_empty((b, h, s), dtype=_acc_dtype(q.dtype))
    return out, lse


@torch.library.register_fake("cplib_c::ring_sdpa_backward")
def _ring_sdpa_backward_fake(grad_out, q, k, v, out, lse, group_name, is_causal, load_balanced,
                             scale, backend, rotate, cu_seqlens=None, window=None, seq_len=None,
                             per_document=False, q_positions=None, kv_positions=None,
                             ring_pass=0):
    reject_real_in_fake("ring_sdpa_backward", grad_out, q, k, v, out, lse, cu_seqlens, q_positions,
                        kv_positions)
    _check("ring_sdpa_backward", q, k, v, group_name, is_causal, load_balanced, scale, backend,
           rotate, cu_seqlens, window, seq_len, per_document, q_positions, kv_positions)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def sinks_grad(grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
               sinks: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks from the sunk (out, lse): ``-sum over batch and rows of
    rowsum(dO * O) * exp(s - lse)``, this rank's rows only (parameters'
    gradients are summed over the context-parallel ranks, as for weights)."""
    acc = lse.dtype
    delta = (grad_out.to(acc) * out.to(acc)).sum(-1)
    prob = torch.exp(sinks.to(acc).view(1, -1, 1) - lse)
    return -(delta * prob).sum((0, 2)).to(sinks.dtype)


def attention_autograd(backward_op, forward_op):
    """(setup_context, backward) for an attention op returning (out, lse)
    whose inputs are q, k, v and then non-tensor arguments, and whose
    ``backward_op(grad_out, q, k, v, out, lse, *args)`` gives (dq, dk, dv).
    A ``sinks`` argument of ``forward_op`` (found by name in its schema) is
    left out of ``args``: the backward kernel run with the sunk (out, lse) is
    already exact, and the sinks' own gradient is :func:`sinks_grad`."""
    names = [a.name for a in forward_op.default._schema.arguments]
    sinks_at = names.index("sinks") - 3 if "sinks" in names else None

    def setup(ctx, inputs, output):
        q, k, v, *args = inputs
        out, lse = output
        sinks = None
        ctx.sinks_at = sinks_at if sinks_at is not None and sinks_at < len(args) else None
        if ctx.sinks_at is not None:
            sinks = args[sinks_at]
            args = args[:sinks_at] + args[sinks_at + 1:]
        ctx.args = args
        ctx.has_sinks = sinks is not None
        ctx.save_for_backward(q, k, v, out, lse, *([sinks] if sinks is not None else []))
        # As for ATen's fused attention kernels, the log-sum-exp is an
        # auxiliary output that autograd does not differentiate.
        ctx.mark_non_differentiable(lse)

    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, *sinks = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        dq, dk, dv = backward_op(grad_out, q, k, v, out, lse, *ctx.args)
        grads = [None] * len(ctx.args)
        if ctx.sinks_at is not None:
            ds = None
            if ctx.has_sinks and ctx.needs_input_grad[3 + ctx.sinks_at]:
                ds = sinks_grad(grad_out, out, lse, sinks[0])
            grads.insert(ctx.sinks_at, ds)
        return (dq, dk, dv, *grads)

    return setup, backward


_setup, _backward = attention_autograd(ops.ring_sdpa_backward, ops.ring_sdpa)
torch.library.register_autograd("cplib_c::ring_sdpa", _backward, setup_context=_setup)


def ring_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: GroupLike,
    *,
    is_causal: bool = False,
    load_balanced: bool = False,
    scale: float | None = None,
    rotate: str = "p2p",
    backend: str | None = None,
    cu_seqlens: torch.Tensor | None = None,
    window: int | tuple[int | None, int | None] | None = None,
    seq_len: int | None = None,
    per_document: bool = False,
    sinks: torch.Tensor | None = None,
    q_positions: torch.Tensor | None = None,
    kv_positions: torch.Tensor | None = None,
    ring_pass: Literal["kv", "q", "auto"] = "kv",
    attn_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring attention of the local shards ``q`` (B, Hq, S_local, D) and ``k``/``v``
    (B, Hkv, S_local, D; v's head dim may differ from q/k's, as in MLA) over
    ``group`` (a ProcessGroup or its name).

    Returns ``(out, lse)``: ``out`` (B, Hq, S_local, D_v) in q's dtype and ``lse``
    (B, Hq, S_local), float32 (float64 for float64 inputs), the natural-log
    log-sum-exp of the scaled scores over every key of the global sequence.
    With ``load_balanced`` the shards are in head-tail layout (rank r holds
    chunks r and 2N-1-r of 2N). K/V rotate with their own Hkv heads (GQA).
    ``rotate`` is "p2p", "alltoall" or "allgather"; ``backend`` is None/"auto",
    "flash", "efficient" or "cudnn" (CUDA only; CPU always uses flash).
    Only ``out`` is differentiable.

    ``cu_seqlens`` (integer tensor ``[0, s1, ..., S]`` of global document
    boundaries, the same on every rank): attention stays within each document
    (causal within it with ``is_causal``). ``window``: ``(left, right)`` or
    ``w`` for ``(w, w)``; query i sees key j iff ``i - left <= j <= i + right``
    in global positions (``None`` on a side: no limit; ``is_causal`` makes
    right 0). ``seq_len``: the global length S when the shards are uneven
    (any S >= world size; see ``cplib.ring.layout``); by default S is the
    local length times the world size. Blocks nobody can see are neither
    computed nor sent (p2p and alltoall). ``per_document``: the shards are
    cut head-tail inside every document (``cplib.ring.layout`` with
    ``documents``; needs ``cu_seqlens`` and ``seq_len``).

    ``sinks`` (Hq,): attention sinks (gpt-oss), one logit per q head that
    joins every row's softmax denominator once and contributes no value;
    ``out`` and ``lse`` then include it. Differentiable in ``sinks`` too
    (its gradient covers this rank's rows).

    ``q_positions`` / ``kv_positions`` (1-D integer tensors, both or
    neither): the global positions of this rank's q rows and k/v rows, in
    local order, the same for every batch row. The mask is then read on them
    (causal: ``kv_pos <= q_pos``; the window and the documents likewise), the
    ranks may hold different lengths (zero queries too), and q and k/v may
    cover different tokens: T new queries against a persistent cache of P + T
    keys. They exclude ``load_balanced``, ``seq_len`` and ``per_document``.

    ``ring_pass``: "kv" rotates k/v (differentiable); "q" rotates the queries
    and returns each partial (out, lse) to its owner (forward only: cheaper
    when few new queries meet a long cache); "auto" picks the one that moves
    fewer bytes (:func:`ring_pass_auto`), and "kv" whenever a gradient is
    needed. The choice is logged at debug level on the "cplib" logger.

    ``attn_mask``: a key-padding mask (boolean, True = attend, or additive)
    of this rank's keys, broadcastable to (B, 1, 1, S_local); it travels with
    its K/V block (cplib/ring/key_padding.py). Other shapes raise
    NotImplementedError.
    """
    if attn_mask is not None:
        from .key_padding import key_padding_inputs

        q, k, v, scale, _ = key_padding_inputs("ring_sdpa", attn_mask, q, k, v, scale)
        return ring_sdpa(q, k, v, group, is_causal=is_causal, load_balanced=load_balanced,
                         scale=scale, rotate=rotate, backend=backend, cu_seqlens=cu_seqlens,
                         window=window, seq_len=seq_len, per_document=per_document,
                         sinks=sinks, q_positions=q_positions, kv_positions=kv_positions,
                         ring_pass=ring_pass)
    name = group_name_of(group)
    wants_grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v))

    def args():
        check_inputs("ring_sdpa", q=q, k=k, v=v, cu_seqlens=cu_seqlens, sinks=sinks,
                     q_positions=q_positions, kv_positions=kv_positions)
        if not isinstance(ring_pass, str) or ring_pass not in RING_PASS_CODES:
            raise ValueError(f"cplib.ring_sdpa: ring_pass={ring_pass!r} is not one of "
                             "'kv', 'q', 'auto'")
        if ring_pass == "q" and wants_grad:
            raise ValueError("cplib.ring_sdpa: ring_pass='q' is forward only, but q, k or v "
                             "requires grad: use ring_pass=\"kv\" (or run under "
                             "torch.no_grad())")
        return (rotate_arg("ring_sdpa", rotate), backend_arg("ring_sdpa", backend),
                scale_arg("ring_sdpa", scale), window_arg(window),
                int_arg("ring_sdpa", "seq_len", seq_len),
                RING_PASS_CODES["kv" if wants_grad else ring_pass])

    rotate_code, backend_code, scale, window, seq_len, pass_code = agreed(
        "ring_sdpa", name, (q, k, v, cu_seqlens), args)
    out = ops.ring_sdpa(q, k, v, name, bool(is_causal), bool(load_balanced), scale,
                        backend_code, rotate_code, cu_seqlens, window, seq_len,
                        bool(per_document), sinks, q_positions, kv_positions, pass_code)
    if ring_pass == "auto" and log.isEnabledFor(logging.DEBUG) and not _is_fake(q):
        chosen = "q" if ops.ring_debug_last_pass() == RING_PASS_CODES["q"] else "kv"
        log.debug("cplib.ring_sdpa: ring_pass='auto' chose %r%s", chosen,
                  " (a gradient is needed)" if wants_grad else "")
    return out


def ring_pass_auto(q_tokens: int, kv_tokens: int, q_heads: int, kv_heads: int, head_dim: int,
                   v_head_dim: int | None = None, dtype: torch.dtype = torch.float32,
                   requires_grad: bool = False) -> Literal["kv", "q"]:
    """The ring pass ``ring_pass="auto"`` picks: "q" when sending every query
    (``q_tokens * q_heads * head_dim`` elements) and returning its partial
    out and lse (``q_tokens * q_heads * (v_head_dim + 1)`` in the accumulator
    dtype, float32 or float64) moves fewer bytes than sending every key and
    value (``kv_tokens * kv_heads * (head_dim + v_head_dim)``); else "kv".
    Token counts are global (summed over the ranks). Always "kv" when a
    gradient is needed. The same rule as csrc/torch/ring/ring_args.cpp."""
    if requires_grad:
        return "kv"
    dv = head_dim if v_head_dim is None else v_head_dim
    elem = torch.empty((), dtype=dtype).element_size()
    acc = 8 if dtype == torch.float64 else 4
    kv_bytes = kv_tokens * kv_heads * (head_dim + dv) * elem
    q_bytes = q_tokens * q_heads * (head_dim * elem + (dv + 1) * acc)
    return "q" if q_bytes < kv_bytes else "kv"


