"""Fake kernels and autograd for ``cplib_c::ring_sdpa`` (ring attention over a
process group, implemented in C++: csrc/torch/ring/) and its Python
entry point ``ring_sdpa``."""

from __future__ import annotations

import math

import torch

from ._native import GroupLike, group_name_of, group_size, ops
from ._seq_layout import local_length

__all__ = ["ring_sdpa", "ROTATE_CODES", "BACKEND_CODES"]

# Integer codes of the ops' `rotate` and `backend` arguments (see csrc/torch/ring/ring.h).
ROTATE_CODES: dict[str, int] = {"p2p": 0, "alltoall": 1, "allgather": 2}
# -1 = auto: chosen as scaled_dot_product_attention would (honours
# torch.nn.attention.sdpa_kernel); the others are at::SDPBackend values.
# CPU always runs the CPU flash kernel and accepts only auto and flash.
BACKEND_CODES: dict[str | None, int] = {None: -1, "auto": -1, "flash": 1, "efficient": 2,
                                        "cudnn": 3}

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


def _check(op: str, q, k, v, group_name: str, is_causal: bool, load_balanced: bool,
           scale: float | None, backend: int, rotate: int, cu_seqlens=None, window=None,
           seq_len=None, per_document=False) -> None:
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
    if k.shape[1:3] != v.shape[1:3]:
        raise ValueError(f"cplib.{op}: k {tuple(k.shape)} and v {tuple(v.shape)} must agree in "
                         "heads and length")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"cplib.{op}: q head dim {q.shape[3]} differs from k head dim "
                         f"{k.shape[3]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"cplib.{op}: q has {q.shape[1]} heads, which is not a multiple of "
                         f"k/v's {k.shape[1]} heads")
    if q.shape[2] == 0 or k.shape[2] == 0:
        raise ValueError(f"cplib.{op}: empty local sequence (q length {q.shape[2]}, kv length "
                         f"{k.shape[2]})")
    if q.shape[3] == 0 or v.shape[3] == 0:
        raise ValueError(f"cplib.{op}: empty head dim")
    if q.device.type != "cuda":
        if q.device.type not in ("cpu", "meta"):
            raise ValueError(f"cplib.{op}: unsupported device {q.device}")
        if v.shape[3] != q.shape[3]:
            raise ValueError(f"cplib.{op}: the CPU kernel needs v's head dim ({v.shape[3]}) to "
                             f"equal q/k's ({q.shape[3]})")
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
    if is_causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"cplib.{op}: is_causal needs equal local q and kv lengths, got q "
                         f"{q.shape[2]} and kv {k.shape[2]}")
    if seq_len is None and not per_document and load_balanced and (q.shape[2] % 2 or
                                                                   k.shape[2] % 2):
        raise ValueError(f"cplib.{op}: load_balanced needs even local lengths (two chunks per "
                         f"rank), got q {q.shape[2]} and kv {k.shape[2]}")
    if group_name is None:  # a world-of-one check (cplib/_ulysses.py)
        return
    group_size(group_name)  # ValueError for an unknown group
    _check_extras(op, q, k, group_name, load_balanced, cu_seqlens, window, seq_len, per_document)


@torch.library.register_fake("cplib_c::ring_sdpa")
def _ring_sdpa_fake(q, k, v, group_name, is_causal, load_balanced, scale, backend, rotate,
                    cu_seqlens=None, window=None, seq_len=None, per_document=False):
    _check("ring_sdpa", q, k, v, group_name, is_causal, load_balanced, scale, backend, rotate,
           cu_seqlens, window, seq_len, per_document)
    b, h, s, _ = q.shape
    out = q.new_empty((b, h, s, v.shape[3]))
    lse = q.new_empty((b, h, s), dtype=_acc_dtype(q.dtype))
    return out, lse


@torch.library.register_fake("cplib_c::ring_sdpa_backward")
def _ring_sdpa_backward_fake(grad_out, q, k, v, out, lse, group_name, is_causal, load_balanced,
                             scale, backend, rotate, cu_seqlens=None, window=None, seq_len=None,
                             per_document=False):
    _check("ring_sdpa_backward", q, k, v, group_name, is_causal, load_balanced, scale, backend,
           rotate, cu_seqlens, window, seq_len, per_document)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def attention_autograd(backward_op):
    """(setup_context, backward) for an attention op returning (out, lse)
    whose inputs are q, k, v and then non-tensor arguments, and whose
    ``backward_op(grad_out, q, k, v, out, lse, *args)`` gives (dq, dk, dv)."""

    def setup(ctx, inputs, output):
        q, k, v, *args = inputs
        out, lse = output
        ctx.args = args
        ctx.save_for_backward(q, k, v, out, lse)
        # As for ATen's fused attention kernels, the log-sum-exp is an
        # auxiliary output that autograd does not differentiate.
        ctx.mark_non_differentiable(lse)

    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        dq, dk, dv = backward_op(grad_out, q, k, v, out, lse, *ctx.args)
        return (dq, dk, dv) + (None,) * len(ctx.args)

    return setup, backward


_setup, _backward = attention_autograd(ops.ring_sdpa_backward)
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
    attn_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring attention of the local shards ``q`` (B, Hq, S_local, D) and ``k``/``v``
    (B, Hkv, S_local, D) over ``group`` (a ProcessGroup or its name).

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
    (any S >= world size; see ``cplib._seq_layout``); by default S is the
    local length times the world size. Blocks nobody can see are neither
    computed nor sent (p2p and alltoall). ``per_document``: the shards are
    cut head-tail inside every document (``cplib._seq_layout`` with
    ``documents``; needs ``cu_seqlens`` and ``seq_len``). ``attn_mask``: a
    key-padding mask (boolean, True = attend, or additive) of this rank's
    keys, broadcastable to (B, 1, 1, S_local); it travels with its K/V block
    (cplib/_key_padding.py). Other shapes raise NotImplementedError.
    """
    if attn_mask is not None:
        from ._key_padding import key_padding_inputs

        q, k, v, scale, dv = key_padding_inputs("ring_sdpa", attn_mask, q, k, v, scale)
        out, lse = ring_sdpa(q, k, v, group, is_causal=is_causal, load_balanced=load_balanced,
                             scale=scale, rotate=rotate, backend=backend, cu_seqlens=cu_seqlens,
                             window=window, seq_len=seq_len, per_document=per_document)
        return out[..., :dv], lse
    if rotate not in ROTATE_CODES:
        raise ValueError(f"cplib.ring_sdpa: rotate={rotate!r} is not one of "
                         f"{sorted(ROTATE_CODES)}")
    if backend not in BACKEND_CODES:
        raise ValueError(f"cplib.ring_sdpa: backend={backend!r} is not one of None, 'auto', "
                         "'flash', 'efficient', 'cudnn'")
    if scale is not None:
        scale = float(scale)
    return ops.ring_sdpa(q, k, v, group_name_of(group), bool(is_causal), bool(load_balanced),
                         scale, BACKEND_CODES[backend], ROTATE_CODES[rotate], cu_seqlens,
                         window_arg(window), seq_len, bool(per_document))


# A window side without limit: the op clamps every side to S.
_NO_LIMIT = 2 ** 62


def window_arg(window) -> list[int] | None:
    """``window`` as the op's ``int[]?``: ``w`` -> ``[w, w]``; ``None`` sides
    -> no limit; negative sides raise ValueError naming the value."""
    if window is None:
        return None
    pair = (window, window) if isinstance(window, int) else tuple(window)
    if len(pair) != 2:
        raise ValueError(f"cplib.ring_sdpa: window={window!r} must be an int or (left, right)")
    out = []
    for side in pair:
        if side is None:
            out.append(_NO_LIMIT)
        elif not isinstance(side, int) or isinstance(side, bool) or side < 0:
            raise ValueError(f"cplib.ring_sdpa: window={window!r} must be non-negative ints "
                             "(or None for no limit)")
        else:
            out.append(side)
    return out
