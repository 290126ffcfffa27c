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
        return group.group_name
    if not isinstance(group, str):
        raise ValueError(f"cplib: expected a process group or its name, got {type(group).__name__}")
    return group


def group_size(group_name: str) -> int:
    """Size of the group registered as ``group_name``; only reads its size, so
    fake kernels may call it. Unknown names raise ValueError."""
    try:
        return dist.distributed_c10d._get_group_size_by_name(group_name)
    except Exception as exc:  # torch raises RuntimeError/ValueError by version
        raise ValueError(
            f"cplib: no process group is registered under the name '{group_name}' "
            "(pass group.group_name of an initialised group)"
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
