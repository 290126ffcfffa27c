"""Fake kernels and autograd for ``cplib_c::ring_sdpa`` (ring attention over a
process group, implemented in C++: csrc/torch/ring/) and its Python
entry point ``ring_sdpa``."""

from __future__ import annotations

import logging
import math
import numbers
from typing import Literal

import torch

from ..comm.handshake import agreed
from ..comm.native import GroupLike, group_name_of, group_size, ops, reject_mixed_meta, \
    reject_real_in_fake
from .layout import local_length

__all__ = ["ring_sdpa", "ring_pass_auto", "ROTATE_CODES", "BACKEND_CODES", "RING_PASS_CODES"]

log = logging.getLogger("cplib")

# Integer codes of the ops' `rotate` and `backend` arguments (see csrc/torch/ring/ring.h).
ROTATE_CODES: dict[str, int] = {"p2p": 0, "alltoall": 1, "allgather": 2}
# -1 = auto: chosen as scaled_dot_product_attention would (honours
# torch.nn.attention.sdpa_kernel); the others are at::SDPBackend values.
# CPU always runs the CPU flash kernel and accepts only auto and flash.
BACKEND_CODES: dict[str | None, int] = {None: -1, "auto": -1, "flash": 1, "efficient": 2,
                                        "cudnn": 3}

# Codes of the op's `ring_pass` argument (see csrc/torch/ring/ring.h).
RING_PASS_CODES: dict[str, int] = {"kv": 0, "q": 1, "auto": 2}

_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake
    return t.device.type == "meta" or is_fake(t)


def _fmt(values: list[int]) -> str:
    if len(values) > 12:
        return "[" + ", ".join(map(str, values[:8])) + ", ..., " + ", ".join(
            map(str, values[-3:])) + "]"
    return str(values)


def check_cu_seqlens(op: str, cu_seqlens, seq_len: int) -> None:
    """The checks of csrc/torch/ring/ring_args.cpp on cu_seqlens; the values
    only where they can be read (not while tracing with fake tensors)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(f"cplib.{op}: cu_seqlens must be an integer tensor, got "
                         f"{type(cu_seqlens).__name__}")
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex or \
            cu_seqlens.dtype == torch.bool:
        raise ValueError(f"cplib.{op}: cu_seqlens must be an integer tensor, got dtype "
                         f"{cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cplib.{op}: cu_seqlens must be 1-D with at least 2 entries "
                         f"[0, ..., S], got shape {list(cu_seqlens.shape)}")
    if _is_fake(cu_seqlens):
        return
    b = cu_seqlens.tolist()
    if b[0] != 0:
        raise ValueError(f"cplib.{op}: cu_seqlens must start at 0, got {b[0]} in {_fmt(b)}")
    if b[-1] != seq_len:
        raise ValueError(f"cplib.{op}: cu_seqlens must end at the sequence length {seq_len}, "
                         f"got {b[-1]} in {_fmt(b)}")
    for i in range(1, len(b)):
        if b[i] <= b[i - 1]:
            raise ValueError(f"cplib.{op}: cu_seqlens must be strictly increasing, got "
                             f"{b[i - 1]} then {b[i]} at index {i} in {_fmt(b)}")


def _group_rank(group_name: str) -> int | None:
    """This process's rank in the group (reads no data, sends nothing)."""
    try:
        return torch.distributed.distributed_c10d._resolve_process_group(group_name).rank()
    except Exception:  # private helper: if it moves, C++ still checks
        return None


def _check_extras(op: str, q, k, group_name: str, load_balanced: bool, cu_seqlens, window,
                  seq_len, per_document: bool = False) -> None:
    # In the order of check_extras in csrc/torch/ring/ring_args.cpp.
    n = group_size(group_name)
    lq, lk = q.shape[2], k.shape[2]
    sq, sk = lq * n, lk * n
    if seq_len is not None:
        if seq_len < n:
            raise ValueError(f"cplib.{op}: seq_len={seq_len} is shorter than the world size {n} "
                             "(every rank needs a token)")
        sq = sk = seq_len
    if (cu_seqlens is not None or window is not None) and sq != sk:
        raise ValueError(f"cplib.{op}: cu_seqlens and window need q and k/v of one global "
                         f"length, got q {sq} and kv {sk}")
    if per_document and (cu_seqlens is None or seq_len is None):
        raise ValueError(f"cplib.{op}: per_document=True (head-tail inside every document) "
                         "needs cu_seqlens and seq_len")
    if cu_seqlens is not None:
        check_cu_seqlens(op, cu_seqlens, sq)
    rank = _group_rank(group_name)
    if seq_len is not None and rank is not None:
        docs = None
        if per_document:
            docs = None if _is_fake(cu_seqlens) else cu_seqlens.tolist()
        if not per_document or docs is not None:
            want = local_length(seq_len, n, rank, load_balanced, docs)
            if lq != want or lk != want:
                layout = ("per-document head-tail" if per_document
                          else "head-tail" if load_balanced else "sequential")
                raise ValueError(f"cplib.{op}: seq_len={seq_len} over {n} ranks ({layout} "
                                 f"layout) gives rank {rank} {want} rows, but q has {lq} and "
                                 f"k/v {lk}")
    if window is not None:
        w = list(window)
        if len(w) != 2:
            raise ValueError(f"cplib.{op}: window must be (left, right), got {w}")
        if w[0] < 0 or w[1] < 0:
            raise ValueError(f"cplib.{op}: window={w} must be non-negative (None for no limit)")


def _check_positions(op: str, name: str, pos, rows: int, rows_of: str) -> None:
    if pos is None:
        raise ValueError(f"cplib.{op}: {name} is missing: give q_positions and kv_positions "
                         "together, or neither")
    if not isinstance(pos, torch.Tensor) or pos.dtype.is_floating_point or \
            pos.dtype.is_complex or pos.dtype == torch.bool:
        what = pos.dtype if isinstance(pos, torch.Tensor) else type(pos).__name__
        raise ValueError(f"cplib.{op}: {name} must be an integer tensor, got dtype {what}")
    if pos.dim() != 1:
        raise ValueError(f"cplib.{op}: {name} must be 1-D (one global position per row), got "
                         f"shape {list(pos.shape)}")
    if pos.shape[0] != rows:
        raise ValueError(f"cplib.{op}: {name} has {pos.shape[0]} positions but {rows_of} has "
                         f"{rows} rows")
    if rows and not _is_fake(pos) and int(pos.min()) < 0:
        raise ValueError(f"cplib.{op}: {name} must be non-negative, got {int(pos.min())}")


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
    if group_name is None:  # a world-of-one check (cplib/ulysses/op.py)
        return
    group_size(group_name)  # ValueError for an unknown group
    _check_extras(op, q, k, group_name, load_balanced, cu_seqlens, window, seq_len, per_document)


def check_sinks(op: str, q, sinks) -> None:
    """The checks of check_sinks in csrc/torch/ring/ring_sinks.cpp."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor) or sinks.dim() != 1 or sinks.shape[0] != q.shape[1]:
        shape = list(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(f"cplib.{op}: sinks must have shape ({q.shape[1]},) (one logit per q "
                         f"head), got {shape}")
    if sinks.device != q.device:
        raise ValueError(f"cplib.{op}: sinks must be on {q.device}, got {sinks.device}")
    if sinks.dtype not in (q.dtype, torch.float32, torch.float64):
        raise ValueError(f"cplib.{op}: sinks must have q's dtype ({q.dtype}) or "
                         f"float32/float64, got {sinks.dtype}")


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


_OPTIONAL_TENSORS = ("cu_seqlens", "sinks", "q_positions", "kv_positions")


def check_inputs(op: str, **tensors) -> None:
    """The entry points' checks of their tensor arguments, before dispatch:
    tensors where tensors belong (None for the optional ones, cu_seqlens),
    and no meta device mixed with real ones."""
    for key, t in tensors.items():
        if t is None and key in _OPTIONAL_TENSORS:
            continue
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"cplib.{op}: {key} must be a torch.Tensor, got {type(t).__name__}")
    reject_mixed_meta(op, **tensors)


def rotate_arg(op: str, rotate) -> int:
    if not isinstance(rotate, str) or rotate not in ROTATE_CODES:
        raise ValueError(f"cplib.{op}: rotate={rotate!r} is not one of {sorted(ROTATE_CODES)}")
    return ROTATE_CODES[rotate]


def backend_arg(op: str, backend) -> int:
    if not (backend is None or isinstance(backend, str)) or backend not in BACKEND_CODES:
        raise ValueError(f"cplib.{op}: backend={backend!r} is not one of None, 'auto', "
                         "'flash', 'efficient', 'cudnn'")
    return BACKEND_CODES[backend]


def scale_arg(op: str, scale) -> float | None:
    """``scale`` as the op's ``float?``: a real number or None."""
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise ValueError(f"cplib.{op}: scale must be a number or None, got "
                         f"{type(scale).__name__}" + (" (pass float(scale))"
                                                      if isinstance(scale, torch.Tensor) else ""))
    scale = float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"cplib.{op}: scale={scale} must be a finite positive number or None")
    return scale


def int_arg(op: str, what: str, value) -> int | None:
    """An optional integer argument (None stays None)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"cplib.{op}: {what} must be an int or None, got {value!r} "
                         f"({type(value).__name__})")
    if not -2 ** 63 <= int(value) < 2 ** 63:
        raise ValueError(f"cplib.{op}: {what}={value} does not fit in 64 bits")
    return int(value)


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


# A window side without limit: the op clamps every side to S.
_NO_LIMIT = 2 ** 62


def window_arg(window) -> list[int] | None:
    """``window`` as the op's ``int[]?``: ``w`` -> ``[w, w]``; ``None`` sides
    (and sides of 2**62 or more, beyond any sequence) -> no limit; anything
    but a non-negative int or None raises ValueError naming the value."""
    if window is None:
        return None
    if isinstance(window, numbers.Integral) and not isinstance(window, bool):
        pair = (window, window)
    elif isinstance(window, (tuple, list)):
        pair = tuple(window)
    else:
        raise ValueError(f"cplib.ring_sdpa: window={window!r} must be an int, (left, right) or "
                         f"None, got {type(window).__name__}")
    if len(pair) != 2:
        raise ValueError(f"cplib.ring_sdpa: window={window!r} must be an int or (left, right)")
    out = []
    for side in pair:
        if side is None:
            out.append(_NO_LIMIT)
        elif isinstance(side, bool) or not isinstance(side, numbers.Integral) or side < 0:
            raise ValueError(f"cplib.ring_sdpa: window={window!r} must be non-negative ints "
                             f"(or None for no limit); got a side {side!r} "
                             f"({type(side).__name__})")
        else:
            out.append(min(int(side), _NO_LIMIT))
    return out
