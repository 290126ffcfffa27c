"""Loads the native extension (which registers every ``cplib_c::`` op) and
holds the small helpers the Python op registrations share."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from . import _C  # noqa: F401  (importing it runs the TORCH_LIBRARY registrations)

ops = torch.ops.cplib_c

GroupLike = str | dist.ProcessGroup


def group_name_of(group: GroupLike) -> str:
    """Accepts a group name or a ProcessGroup and returns the registered name."""
    if isinstance(group, dist.ProcessGroup):
        name = group.group_name
    elif isinstance(group, str):
        name = group
    else:
        raise ValueError(f"cplib: expected a process group or its name, got {type(group).__name__}")
    if not torch.compiler.is_compiling():
        _register_handshake_group(name)
    return name


_handshake_groups: set[str] = set()


def _register_handshake_group(name: str) -> None:
    """Handshakes of a group run over the first live group with the same
    ranks (in order) and backend, so that ranks passing different group
    objects for those ranks meet in one collective and are told so, instead
    of each waiting in its own."""
    if name in _handshake_groups:
        return
    c10d = dist.distributed_c10d
    try:
        pg = c10d._resolve_process_group(name)
        key = (c10d.get_process_group_ranks(pg), dist.get_backend(pg))
    except Exception:  # unknown here: the op raises, naming it
        return
    _handshake_groups.add(name)
    for other, other_name in list(c10d._world.pg_names.items()):
        if other_name == name:
            return
        try:
            if (c10d.get_process_group_ranks(other), dist.get_backend(other)) == key:
                ops.handshake_group(name, other_name)
                return
        except Exception:  # not a member, or gone
            continue


def reject_mixed_meta(op: str, **tensors) -> None:
    """ValueError when the meta device is mixed with real ones among the
    inputs: dispatch would send the call to the fake kernel, which computes
    nothing."""
    given = {k: t for k, t in tensors.items() if isinstance(t, torch.Tensor)}
    meta = [k for k, t in given.items() if t.device.type == "meta"]
    if meta and len(meta) != len(given):
        devices = ", ".join(f"{k} on {t.device}" for k, t in given.items())
        raise ValueError(f"cplib.{op}: {', '.join(meta)} on the meta device mixed with real "
                         f"tensors ({devices}); put every input on one real device")


def reject_real_in_fake(op: str, *tensors) -> None:
    """In a fake kernel: a real (not fake, not meta) input means another input
    was on the meta device and dispatch chose this kernel (see reject_mixed_meta)."""
    from torch._subclasses.fake_tensor import is_fake
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta" and not is_fake(t):
            raise ValueError(f"cplib.{op}: inputs mix the meta device with real tensors (one is "
                             f"on {t.device}); put every input on one real device")


def group_size(group_name: str) -> int:
    """Size of the group registered as ``group_name``; only reads its size, so
    fake kernels may call it. Unknown names raise ValueError."""
    try:
        return dist.distributed_c10d._get_group_size_by_name(group_name)
    except Exception as exc:  # torch raises RuntimeError/ValueError by version
        raise ValueError(
            f"cplib: no process group is registered under the name '{group_name}' "
            "(destroyed, or never initialised: pass group.group_name of a live group)"
        ) from exc


def normalize_dim(dim: int, ndim: int, what: str) -> int:
    if ndim == 0:
        raise ValueError(f"cplib: {what} needs a tensor with at least one dimension")
    if not -ndim <= dim < ndim:
        raise ValueError(
            f"cplib: {what}={dim} is out of range for a tensor with {ndim} dimensions "
            f"(expected in [{-ndim}, {ndim - 1}])"
        )
    return dim % ndim


def check_mesh(mesh: DeviceMesh) -> dist.ProcessGroup:
    """The process group of a 1-D ``mesh``; anything else is a ValueError."""
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"cplib: expected a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        names = mesh.mesh_dim_names
        hint = f'mesh["{names[-1]}"]' if names else 'mesh["cp"]'
        raise ValueError(
            f"cplib: context parallelism needs a 1-D device mesh, got {mesh.ndim}-D mesh of "
            f"shape {tuple(mesh.shape)} (dims {names}); slice the context-parallel dimension, "
            f"e.g. {hint}"
        )
    return mesh.get_group()
