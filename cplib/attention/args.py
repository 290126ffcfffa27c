"""The argument checks and parsers that every attention feature runs in
Python before dispatch (ring, Ulysses, USP, decode, flex, tp_conv, the front
end and the strategy): tensor arguments, cu_seqlens, positions, sinks, the
scale, the window, the backend's name. They match the native checks
(csrc/torch/ring/ring_args.cpp; the sinks' in csrc/torch/attention/sinks.cpp)
message for message, so traced code fails as the op does. The ring's own
(its rotation, the layout of the global sequence) stay in
cplib/ring/args.py."""

from __future__ import annotations

import math
import numbers

import torch

from ..comm.native import reject_mixed_meta
from .names import BACKENDS

__all__ = ["DTYPES", "acc_dtype", "is_fake", "group_rank", "check_cu_seqlens", "check_positions",
           "check_sinks", "check_inputs", "backend_arg", "scale_arg", "int_arg", "window_arg"]

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the lse and of the kernels' accumulators for inputs of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` holds no values to read (meta, or fake while tracing)."""
    from torch._subclasses.fake_tensor import is_fake as fake_tensor
    return t.device.type == "meta" or fake_tensor(t)


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
    if is_fake(cu_seqlens):
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


def group_rank(group_name: str) -> int | None:
    """This process's rank in the group (reads no data, sends nothing)."""
    try:
        return torch.distributed.distributed_c10d._resolve_process_group(group_name).rank()
    except Exception:  # private helper: if it moves, C++ still checks
        return None


def check_positions(op: str, name: str, pos, rows: int, rows_of: str) -> None:
    """``name`` (q_positions or kv_positions): one non-negative integer per row of ``rows_of``."""
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
    if rows and not is_fake(pos) and int(pos.min()) < 0:
        raise ValueError(f"cplib.{op}: {name} must be non-negative, got {int(pos.min())}")


def check_sinks(op: str, q, sinks) -> None:
    """The checks of check_sinks in csrc/torch/attention/sinks.cpp."""
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


def backend_arg(op: str, backend) -> str:
    """``backend`` as the ops take it: a name of ``BACKENDS`` (None is "auto")."""
    if backend is None:
        return "auto"
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"cplib.{op}: backend={backend!r} is not one of None, "
                         f"{', '.join(map(repr, BACKENDS))}")
    return backend


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
