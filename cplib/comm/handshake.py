"""The handshake from Python (the mechanism itself is csrc/torch/comm/handshake.cpp).

Every communicating op starts with one small all-gather in which each rank
says whether its input is valid and describes its call; every rank then
raises the same error, or none does. Checks that run in the Python wrappers
join that handshake through :func:`agreed`: a wrapper that finds its own
argument invalid sends its error in the handshake the other ranks' op is in,
so they raise too instead of waiting. Calls made of Python code only
(sharding, ``context_parallel``) describe themselves with :func:`handshake`.
Fake and meta tensors (tracing) never communicate.
"""

from __future__ import annotations

import os
from typing import Callable, Mapping, Sequence, TypeVar

import torch

from .native import group_size, ops

__all__ = ["handshake_enabled", "agreed", "handshake", "can_handshake", "values_hash"]

T = TypeVar("T")
_ENV = "CPLIB_CHECK_CONSISTENCY"
_MAX_LENGTHS = 8  # Handshake::kMaxLengths


def handshake_enabled() -> bool:
    """Whether cplib's ops begin with the handshake (``CPLIB_CHECK_CONSISTENCY=0``: no)."""
    return os.environ.get(_ENV) != "0"


def _tracing(tensors: Sequence) -> bool:
    """Fake tensors among ``tensors``, or meta ones only: a trace, which never
    communicates (meta mixed with real tensors is an error to agree on)."""
    from torch._subclasses.fake_tensor import is_fake
    given = [t for t in tensors if isinstance(t, torch.Tensor)]
    if any(is_fake(t) for t in given):
        return True
    return bool(given) and all(t.device.type == "meta" for t in given)


def can_handshake(group_name: str | None, tensors: Sequence = ()) -> bool:
    """A handshake is due: on, a known group of more than one rank, and not
    a trace (see _tracing)."""
    if group_name is None or not handshake_enabled():
        return False
    if _tracing(tensors):
        return False
    try:
        return group_size(group_name) > 1
    except ValueError:
        return False


def _kind(exc: BaseException) -> str:
    for cls in (NotImplementedError, TypeError, IndexError, ValueError):
        if isinstance(exc, cls):
            return cls.__name__
    return "RuntimeError"


def agreed(op: str, group_name: str | None, tensors: Sequence, check: Callable[[], T]) -> T:
    """``check()``'s result; an exception it raises is raised on every rank of
    the group: it travels in the handshake of the op the other ranks are in
    (which then raises the same error there), and here as that error. While
    compiling, ``check()`` alone is traced (the op handshakes at run time)."""
    if torch.compiler.is_compiling():
        return check()
    try:
        return check()
    except Exception as exc:
        if can_handshake(group_name, tensors):
            ops.handshake_error(group_name, op, _kind(exc), str(exc))
        raise


def forward_error(op: str, group_name: str | None, exc: BaseException) -> None:
    """Tells the ranks of another group (USP's ring group) about ``exc``, an
    error every rank of this one already agreed on."""
    if can_handshake(group_name):
        try:
            ops.handshake_error(group_name, op, _kind(exc), str(exc))
        except Exception:
            pass  # the error to raise is ``exc``


def values_hash(values: Sequence[int]) -> int:
    """A 63-bit hash of integers, the same in every process (ints hash
    deterministically in Python)."""
    return hash(tuple(int(v) for v in values)) & (2 ** 63 - 1)


def handshake(group_name: str, op: str, tensors: Mapping[str, torch.Tensor] | None = None,
              fields: Mapping[str, int] | None = None,
              lengths: Sequence[int] = ()) -> list[list[int]] | None:
    """One handshake for a call described by ``tensors`` (their rank, sizes,
    dtype and device type) and ``fields`` (named integers): raises the same
    ValueError on every rank when they differ. Returns every rank's
    ``lengths``, or None when there was no handshake (off, a world of one,
    fake tensors)."""
    tensors = dict(tensors or {})
    fields = dict(fields or {})
    if not can_handshake(group_name, list(tensors.values())):
        return None
    lengths = [int(x) for x in lengths]
    n = group_size(group_name)
    out: list[list[int]] = [[] for _ in range(n)]
    for start in range(0, max(len(lengths), 1), _MAX_LENGTHS):
        part = lengths[start:start + _MAX_LENGTHS]
        # The description travels once; further lengths in further handshakes.
        flat = ops.handshake(group_name, op, list(tensors.values()) if start == 0 else [],
                             list(tensors) if start == 0 else [],
                             list(fields) if start == 0 else [],
                             [int(v) for v in fields.values()] if start == 0 else [], part)
        for r in range(n):
            out[r] += flat[r * len(part):(r + 1) * len(part)]
    return out
