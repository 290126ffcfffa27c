"""Loads the native extension (which registers every ``cplib_c::`` op) and
holds the small helpers the Python op registrations share."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .. import _C  # noqa: F401  (importing it runs the op registrations)

_PYTHON_CLASSES = {cls.__name__: cls for cls in
                   (ValueError, NotImplementedError, TypeError, IndexError, RuntimeError)}


def native_error(exc: RuntimeError) -> Exception:
    """The exception a native op meant: on the stable ABI every kernel error
    reaches Python as a RuntimeError whose message starts with the class to
    raise ("ValueError: cplib.ring_sdpa: ..."; csrc/torch/common/errors.h)."""
    head, sep, message = str(exc).partition(": ")
    cls = _PYTHON_CLASSES.get(head) if sep else None
    return exc if cls is None or cls is RuntimeError else cls(message)


class _NativeOp:
    """One ``torch.ops.cplib_c`` op; calling it raises a kernel's error as
    its Python class (see native_error). Its overloads (``.default``) are
    torch's own."""

    # No __slots__: torch.compile guards on the op object's __dict__, and a
    # guard that cannot read it fails on the frame that made it.

    def __init__(self, packet) -> None:
        self._packet = packet

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return self._packet(*args, **kwargs)
        try:
            return self._packet(*args, **kwargs)
        except RuntimeError as exc:
            err = native_error(exc)
            if err is exc:
                raise
            raise err from None

    def __getattr__(self, name: str):
        return getattr(self._packet, name)


class _NativeOps:
    """``torch.ops.cplib_c`` with each op wrapped in _NativeOp."""

    def __getattr__(self, name: str) -> _NativeOp:
        op = _NativeOp(getattr(torch.ops.cplib_c, name))
        setattr(self, name, op)
        return op


ops = _NativeOps()

# The stable ABI has no process-group API, and torch's functional collectives
# take their group as `Any` from torch 2.13 on, which the stable dispatcher
# call cannot pass: the native layer reaches groups through these ops
# (schemas in csrc/torch/comm/collectives.cpp).
_comm_lib = torch.library.Library("cplib_c", "IMPL")
_functional = torch.ops._c10d_functional


def _group_info(group_name: str) -> list[int]:
    """[rank, size, 1 for an NCCL group], or [] for an unknown name (the
    op then raises ValueError naming it)."""
    c10d = dist.distributed_c10d
    try:
        pg = c10d._resolve_process_group(group_name)
        nccl = dist.get_backend(pg) == "nccl"
        return [pg.rank(), pg.size(), int(nccl)]
    except Exception:  # unknown or destroyed
        return []


def _runs_on_gloo(group_name: str, device: torch.device) -> bool:
    try:
        backend = dist.distributed_c10d._resolve_process_group(group_name)._get_backend(device)
    except Exception:  # no backend for this device: not gloo
        return False
    return isinstance(backend, getattr(dist, "ProcessGroupGloo", ()))


def _all_gather(input: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    if _runs_on_gloo(group_name, input.device):
        # gloo's all-gather (allgather_coalesced, behind the functional op)
        # corrupts the heap when two are in flight at once (two K/V gathers:
        # "malloc(): unaligned tcache chunk detected" within a few hundred
        # calls on torch 2.13, reproduced without cplib); its all-to-all does
        # not. The same exchange as an all-to-all: every rank sends its whole
        # input to every rank, received rank-major as all_gather would.
        rows = input.shape[0]
        splits = [rows] * group_size
        repeated = input.repeat(group_size, *([1] * (input.dim() - 1)))
        return _functional.all_to_all_single(repeated, splits, splits, group_name)
    return _functional.all_gather_into_tensor(input, group_size, group_name)


def _reduce_scatter_sum(input: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    return _functional.reduce_scatter_tensor(input, "sum", group_size, group_name)


def _all_to_all(input: torch.Tensor, output_split_sizes: list[int],
                input_split_sizes: list[int], group_name: str) -> torch.Tensor:
    return _functional.all_to_all_single(input, output_split_sizes, input_split_sizes,
                                         group_name)


for _name, _fn in (("group_info", _group_info), ("c10d_all_gather", _all_gather),
                   ("c10d_reduce_scatter_sum", _reduce_scatter_sum),
                   ("c10d_all_to_all", _all_to_all)):
    _comm_lib.impl(_name, _fn, "CompositeExplicitAutograd")

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
