"""The handshake from Python (the mechanism itself is csrc/torch/comm/handshake.cpp).

Every communicating op starts with one small all-gather in which each rank
says whether its input is valid and describes its call; every rank then
raises the same error, or none does. Checks that run in the Python wrappers
join that handshake through :func:`agreed`: a wrapper that finds its own
argument invalid sends its error in the handshake the other ranks' op is in,
so they raise too instead of waiting. Calls made of Python code only
(sharding, ``context_parallel``) describe themselves with :func:`handshake`.

The record travels in host memory, so the handshake never waits for the GPU:
over the group itself when its backend takes CPU tensors, else over a CPU
(gloo) side group that :func:`register_group` makes (``new_group`` is a
collective: it is made where every rank is known to take part, never inside
an op). Fake tensors and tracing (FakeTensorMode, torch.compile) never
communicate; plain meta tensors on a real group do in ``ring_sdpa``, so that
a rank on meta tensors beside ranks on real ones fails with them.
"""

from __future__ import annotations

import os
from typing import Callable, Mapping, Sequence, TypeVar

import torch

import torch.distributed as dist

from torch.distributed.device_mesh import DeviceMesh

from . import native as _native
from .native import GroupLike, check_mesh, forget_routes, group_size, group_token, \
    ops, side_group, side_groups

__all__ = ["handshake_enabled", "agreed", "handshake", "can_handshake", "values_hash",
           "register_group"]

T = TypeVar("T")
_ENV = "CPLIB_CHECK_CONSISTENCY"
_MAX_LENGTHS = 8  # Handshake::kMaxLengths


def handshake_enabled() -> bool:
    """Whether cplib's ops begin with the handshake (``CPLIB_CHECK_CONSISTENCY=0``: no)."""
    return os.environ.get(_ENV) != "0"


_TRACING_MODES = tuple(getattr(torch._C._TorchDispatchModeKey, key)
                       for key in ("FAKE", "PROXY")
                       if hasattr(torch._C._TorchDispatchModeKey, key))


def tracing(tensors: Sequence = ()) -> bool:
    """A trace, which never communicates: fake tensors among ``tensors``, a
    FakeTensorMode or make_fx's proxy mode active, or compiling. (Other
    dispatch modes, a FlopCounterMode say, run the ops for real.)"""
    from torch._subclasses.fake_tensor import is_fake
    # is_dynamo_compiling, not is_compiling: that is true in every thread while
    # one compiles, and the threaded group's ranks are threads.
    if torch.compiler.is_dynamo_compiling():
        return True
    if any(torch._C._get_dispatch_mode(key) is not None for key in _TRACING_MODES):
        return True
    return any(isinstance(t, torch.Tensor) and is_fake(t) for t in tensors)


def _tracing(tensors: Sequence, meta_joins: bool) -> bool:
    """tracing(), or meta tensors only where the op's meta calls do not
    handshake (``meta_joins``: they do; meta mixed with real tensors is an
    error to agree on)."""
    if tracing(tensors):
        return True
    given = [t for t in tensors if isinstance(t, torch.Tensor)]
    return not meta_joins and bool(given) and all(t.device.type == "meta" for t in given)


def can_handshake(group_name: str | None, tensors: Sequence = (),
                  meta_joins: bool = False) -> bool:
    """A handshake is due: on, a known group of more than one rank, and not
    a trace (see _tracing)."""
    if group_name is None or not handshake_enabled():
        return False
    if _tracing(tensors, meta_joins):
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


def agreed(op: str, group_name: str | None, tensors: Sequence, check: Callable[[], T],
           meta_joins: bool = False) -> T:
    """``check()``'s result; an exception it raises is raised on every rank of
    the group: it travels in the handshake of the op the other ranks are in
    (which then raises the same error there), and here as that error. While
    compiling, ``check()`` alone is traced (the op handshakes at run time).
    ``meta_joins``: the op's calls on plain meta tensors handshake too."""
    if torch.compiler.is_dynamo_compiling():
        return check()
    try:
        return check()
    except Exception as exc:
        share_error(op, group_name, exc, tensors, meta_joins)
        raise


def share_error(op: str, group_name: str | None, exc: BaseException, tensors: Sequence = (),
                meta_joins: bool = False) -> None:
    """Sends ``exc``, raised on this rank before the call's handshake, into
    the handshake the other ranks are in; that handshake raises it on every
    rank, this one included, with one message (``cplib.<op>: invalid input
    on rank N: ...``). Returns where no handshake is due."""
    if can_handshake(group_name, tensors, meta_joins):
        ops.handshake_error(group_name, op, _kind(exc), str(exc))


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
              lengths: Sequence[int] = (), skip_dim: int = -1) -> list[list[int]] | None:
    """One handshake for a call described by ``tensors`` (their rank, sizes,
    dtype and device type; ``skip_dim``, a dim whose size may differ between
    ranks, left out) and ``fields`` (named integers): raises the same
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
                             [int(v) for v in fields.values()] if start == 0 else [], part,
                             skip_dim)
        for r in range(n):
            out[r] += flat[r * len(part):(r + 1) * len(part)]
    return out


def register_group(group: GroupLike | DeviceMesh) -> None:
    """Makes ``group`` known to cplib's handshake; call it on every rank of
    the group, once, after creating the group (``context_parallel`` calls it
    itself). A group whose backend takes CPU tensors (gloo, a
    ``"cpu:gloo,cuda:nccl"`` group) needs nothing: its handshakes run on it.
    For a group that does not (NCCL), this makes a CPU (gloo) side group over
    the same ranks, on which every later handshake of the group travels in
    host memory: without it the handshake falls back to a GPU buffer read
    back to the host, a host-device synchronisation before every
    communicating op (a warning names this call). Making a group is itself a
    collective over its ranks (``dist.new_group``), which is why this is a
    call of its own and never made inside an op, where one rank could be
    alone; groups over the same ranks share one side group. ``group``: a
    ProcessGroup, its name, or a 1-D DeviceMesh."""
    if isinstance(group, DeviceMesh):
        group = check_mesh(group, register=False)
    if isinstance(group, str):
        group_size(group)  # ValueError naming an unknown name
        group = dist.distributed_c10d._resolve_process_group(group)
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"cplib.register_group: expected a process group, its name or a 1-D "
                         f"DeviceMesh, got {type(group).__name__}")
    c10d = dist.distributed_c10d
    pg = group
    ranks = tuple(c10d.get_process_group_ranks(pg))
    if not _native.carries_host_tensors(pg) and len(ranks) > 1 and side_group(ranks) is None:
        # The world: every rank calls new_group. A subgroup: only its members
        # do (use_local_synchronization; its ranks must make groups in one order).
        local = len(ranks) != dist.get_world_size()
        key = (group_token(c10d._get_default_group()), ranks)
        side_groups[key] = dist.new_group(list(ranks), backend="gloo",
                                          use_local_synchronization=local,
                                          group_desc="cplib handshake").group_name
        forget_routes()  # groups over these ranks registered before: now on it too
    _native.forget_route(pg)
    _native._register_handshake_group(pg.group_name, pg)


def register_groups(*groups: GroupLike | None) -> None:
    """:func:`register_group` for each distinct group given (None skipped), in
    the order given: the same order on every rank, as new_group needs."""
    seen: list[str] = []
    for g in groups:
        if g is None:
            continue
        name = g if isinstance(g, str) else g.group_name
        if name not in seen:
            seen.append(name)
            register_group(g)
