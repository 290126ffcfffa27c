"""Loads the native extension (which registers every ``cplib_c::`` op) and
holds the small helpers the Python op registrations share."""

from __future__ import annotations

import itertools
import weakref

import torch
import torch.distributed as dist
# Imported here, before the program makes a group, though only compiling and
# flex need it (about 0.8 s of every process): imported later, inside a call
# that holds a group, dynamo's import keeps that group alive past
# destroy_process_group() until the collector runs (the cause of the abort
# at exit: docs/comm.md). torch.fx's wrap(), run at its import, keeps its own
# frame in a local (a cycle that holds the importer's whole stack:
# tests/comm/test_exit_clean.py failed so when dynamo was imported at a
# loss's first call), and torch.distributed.nn, which it imports, takes the
# default group of that moment as its functions' default argument
# (tests/support/exit_scenario.py).
import torch._dynamo  # noqa: F401
from torch.distributed.device_mesh import DeviceMesh

from .. import _C  # noqa: F401  (importing it runs the op registrations)
from . import cuda_attention  # noqa: F401  (the cuDNN forward the native layer calls)
from .collectives import IMPLEMENTATIONS, _resolve
from .collectives import _runs_on_gloo  # noqa: F401  (tests/flex reads it here)

_PYTHON_CLASSES = {cls.__name__: cls for cls in
                   (ValueError, NotImplementedError, TypeError, IndexError, RuntimeError)}


def native_error(exc: RuntimeError) -> Exception:
    """The exception a native op meant: on the stable ABI every kernel error
    reaches Python as a RuntimeError whose message starts with the class to
    raise ("ValueError: cplib.ring_sdpa: ..."; csrc/torch/common/errors.h),
    that one included ("RuntimeError: cplib...": raised without the prefix,
    which Python's traceback adds itself)."""
    head, sep, message = str(exc).partition(": ")
    cls = _PYTHON_CLASSES.get(head) if sep else None
    return exc if cls is None else cls(message)


def call_translating(func, args: tuple, kwargs: dict):
    """``func(*args, **kwargs)`` for a torch function mode passing a call on:
    a ``cplib_c`` op called from a compiled graph (its packet, not
    _NativeOp) raises its error as the Python class it meant."""
    if torch.compiler.is_dynamo_compiling():
        return func(*args, **kwargs)
    try:
        return func(*args, **kwargs)
    except RuntimeError as exc:
        if not str(func).startswith("cplib_c."):
            raise
        raise native_error(exc) from None


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
            try:
                raise err from None
            finally:
                # The error's traceback holds this frame, and this frame the
                # error: a cycle that would keep every frame of the failed
                # call alive (its tensors and its process group, whose gloo
                # workers then outlive destroy_process_group() and abort
                # the interpreter's exit; tests/comm/test_exit_clean.py).
                del err

    def __getattr__(self, name: str):
        return getattr(self._packet, name)


class _NativeOps:
    """``torch.ops.cplib_c`` with each op wrapped in _NativeOp."""

    def __getattr__(self, name: str) -> _NativeOp:
        op = _NativeOp(getattr(torch.ops.cplib_c, name))
        setattr(self, name, op)
        return op


ops = _NativeOps()

# The stable ABI has no process-group API: the native layer reaches groups
# through Python-implemented ops (schemas in csrc/torch/comm/collectives.cpp):
# group_info here, the collectives of collectives.py.
_comm_lib = torch.library.Library("cplib_c", "IMPL")


# Group tokens: one number per process-group object this process has seen
# (weakly held, by id). torch reuses group names after destroy_process_group
# and a new init; what cplib keeps per group (the handshake's routes, its
# side groups) is keyed by the token, so a new group under an old name
# starts afresh. A token's entry goes with its group object.
_tokens: dict[int, tuple[weakref.ref, int]] = {}
_token_count = itertools.count(1)


def group_token(pg: dist.ProcessGroup) -> int:
    entry = _tokens.get(id(pg))
    if entry is not None and entry[0]() is pg:
        return entry[1]
    key, token = id(pg), next(_token_count)

    def gone(_ref, key=key, token=token):
        if _tokens.get(key, (None, None))[1] == token:
            del _tokens[key]
        _routes.pop(token, None)
        _infos.pop(token, None)
    _tokens[key] = (weakref.ref(pg, gone), token)
    return token


# What _group_info answers for a group object (fixed for its life), by token.
_infos: dict[int, list[int]] = {}


def _group_info(group_name: str) -> list[int]:
    """[rank, size, 1 for an NCCL group, the group's token], or [] for an
    unknown name (the op then raises ValueError naming it)."""
    try:
        pg = _resolve(group_name)
        token = group_token(pg)
        info = _infos.get(token)
        if info is None:
            nccl = dist.get_backend(pg) == "nccl"
            info = _infos[token] = [pg.rank(), pg.size(), int(nccl), token]
        return info
    except Exception:  # unknown or destroyed
        return []


for _name, _fn in (("group_info", _group_info), *IMPLEMENTATIONS.items()):
    _comm_lib.impl(_name, _fn, "CompositeExplicitAutograd")

GroupLike = str | dist.ProcessGroup


def group_name_of(group: GroupLike) -> str:
    """Accepts a group name or a ProcessGroup and returns the registered name."""
    if isinstance(group, dist.ProcessGroup):
        name = group.group_name
    elif isinstance(group, str):
        name = group
    elif isinstance(group, int) and not isinstance(group, bool) and \
            group == dist.GroupMember.NON_GROUP_MEMBER:
        # What dist.new_group returns on the ranks it leaves out.
        raise ValueError(
            f"cplib: group=GroupMember.NON_GROUP_MEMBER ({group}): this process is not a member "
            "of the process group (dist.new_group returns that value on the ranks it leaves "
            "out); call cplib's ops on the group's member ranks only")
    else:
        raise ValueError(f"cplib: expected a process group or its name, got "
                         f"{type(group).__name__} ({group!r})")
    if not torch.compiler.is_compiling():
        _register_handshake_group(name, group if isinstance(group, dist.ProcessGroup) else None)
    return name


# The handshake's routes (csrc/torch/comm/handshake.h: HandshakeRoute): for
# each group (by token), the name of the group its handshakes travel on.
_routes: dict[int, str] = {}
# cplib's CPU (gloo) side groups of groups whose backend takes no CPU
# tensors (NCCL), by (the token of the default group, the global ranks in
# group order): a new init (a new default group) makes new ones. Made by
# cplib.register_group, where every rank of the group is known to be. Their
# names only: c10d holds the groups, so that destroy_process_group() frees
# them and joins their gloo workers (a worker alive at interpreter exit
# aborts it; tests/comm/test_exit_clean.py).
side_groups: dict[tuple[int, tuple[int, ...]], str] = {}


def side_group(ranks: tuple[int, ...]) -> dist.ProcessGroup | None:
    """The live side group over ``ranks`` of this init, if cplib made one."""
    c10d = dist.distributed_c10d
    key = (group_token(c10d._get_default_group()), ranks)
    name = side_groups.get(key)
    if name is None:
        return None
    pg = next((pg for pg, pg_name in c10d._world.pg_names.items() if pg_name == name), None)
    if pg is None:  # destroyed since
        del side_groups[key]
    return pg


def carries_host_tensors(pg: dist.ProcessGroup) -> bool:
    """Whether ``pg``'s collectives take CPU tensors: gloo, a
    "cpu:gloo,cuda:nccl" group, torch's threaded test group; not NCCL."""
    try:
        pg._get_backend(torch.device("cpu"))
        return True
    except Exception:  # no CPU backend: NCCL and other device-only backends,
        pass           # or a Python group (the threaded one) that takes any tensor
    return str(dist.get_backend(pg)).lower() not in ("nccl", "xccl", "hccl")


def _register_handshake_group(name: str, pg: dist.ProcessGroup | None = None) -> None:
    """Handshakes of a group run in host memory over the first live group
    with the same ranks (in order) that takes CPU tensors, so that ranks
    passing different group objects for those ranks meet in one collective
    and are told so, instead of each waiting in its own; for an NCCL group,
    over its side group (cplib.register_group). An NCCL group without one
    falls back to a CUDA buffer read back to the host, and says so once."""
    c10d = dist.distributed_c10d
    try:
        pg = c10d._resolve_process_group(name) if pg is None else pg
        token = group_token(pg)
        if token in _routes:
            return
        ranks = c10d.get_process_group_ranks(pg)
    except Exception:  # unknown here: the op raises, naming it
        return
    side = side_group(tuple(ranks))
    if side is not None and not carries_host_tensors(pg):
        _routes[token] = side.group_name
        ops.handshake_set_route(token, side.group_name, 1, True)
        return
    host = carries_host_tensors(pg)
    via = name
    for other, other_name in list(c10d._world.pg_names.items()):
        if other_name == name:
            break
        try:
            if c10d.get_process_group_ranks(other) == ranks and (
                    carries_host_tensors(other) if host else
                    dist.get_backend(other) == dist.get_backend(pg)):
                via = other_name
                break
        except Exception:  # not a member, or gone
            continue
    _routes[token] = via
    ops.handshake_set_route(token, via, int(host), False)
    if not host and pg.size() > 1:
        import warnings
        warnings.warn(
            f"cplib: process group '{name}' ({dist.get_backend(pg)}) takes no CPU tensors and "
            "has no CPU side group, so cplib's handshake goes through a GPU buffer and waits "
            "for the GPU before every communicating op; call cplib.register_group(group) on "
            "every rank of it once, after creating it (context_parallel does this itself)",
            stacklevel=3)


def forget_route(pg: dist.ProcessGroup) -> None:
    """Chooses ``pg``'s route again at its next registration."""
    _routes.pop(group_token(pg), None)


def forget_routes() -> None:
    """Chooses every live group's route again (after a side group was made)."""
    _routes.clear()
    for pg, name in list(dist.distributed_c10d._world.pg_names.items()):
        if id(pg) in _tokens:
            _register_handshake_group(name, pg)


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


def check_mesh(mesh: DeviceMesh, register: bool = True) -> dist.ProcessGroup:
    """The process group of a 1-D ``mesh``; anything else is a ValueError.
    ``register``: choose its handshake route now (see group_name_of); callers
    that register the group themselves first (context_parallel) say False,
    so that an NCCL group is not warned about before it has its side group."""
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
    try:
        group = mesh.get_group()
    except Exception as exc:  # torch's "Could not resolve the process group ...": name it
        names = getattr(mesh, "_dim_group_names", None) or ["?"]
        raise ValueError(
            f"cplib: the process group of the device mesh (registered as '{names[0]}', mesh "
            f"{mesh.mesh.tolist()}) is not a live group: it was destroyed "
            "(destroy_process_group) or never initialised on this rank; build the mesh from a "
            "live group") from exc
    if register:
        group_name_of(group)  # its handshakes go where the ops' own go (see group_name_of)
    return group
