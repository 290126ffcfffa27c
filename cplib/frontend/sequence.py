"""Where a batch's sequence lives under context parallelism, for the losses
that read labels beside this rank's logits (cplib/loss.py and the
transformers integration's losses) and the layers that read the sequence in
order (hybrid models).

The layout in effect comes from an explicit scope, never from a value a
past call recorded (DESIGN.md section 15): the innermost
``cplib.context_parallel`` region's, else that of a :func:`sharded_scope`
(on the ``_ContextParallel`` module path: a transformers model's forward
given tensors that ``_context_parallel_shard`` cut, which carry their
layout), else, for a loss, the layout its own labels were cut in. Outside
all three a computation is the one-process one. Labels given whole are used
as they are; labels of this rank's shard length are gathered back over the
group (one all-gather of integers) so that they can be shifted across shard
borders. Every check reads shapes and the layout only, and its error is
raised on every rank before any collective.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.overrides import _get_current_function_mode_stack

from ..comm.handshake import agreed
from ..comm.native import check_mesh
from ..ring.load_balancer import shard_lengths
from .sdpa_dispatch import CPDispatchMode, dispatcher_enabled
from .shard_layout import ShardLayout, shard_layout_of
from .sharding import shard_key, shard_tensor, sharded_as
from .unshard import unshard

__all__ = ["SequenceShards", "active_handle", "layout_source", "sequence_shards",
           "labels_in_layout", "sharded_scope", "layout_in_scope", "shards_of",
           "traced_on_the_module_path"]


def active_handle() -> Any:
    """The ContextParallelHandle of the innermost cplib.context_parallel region."""
    for mode in reversed(_get_current_function_mode_stack()):
        if isinstance(mode, CPDispatchMode) and mode.handle is not None:
            return mode.handle
    return None


@dataclass(frozen=True)
class SequenceShards:
    """A sequence of ``seq_len`` tokens cut over ``mesh`` by ``load_balancer``
    (None: sequential); ``source`` names where the layout came from."""

    mesh: DeviceMesh
    load_balancer: Any
    seq_len: int
    source: str

    @property
    def group(self) -> dist.ProcessGroup:
        return check_mesh(self.mesh)

    @property
    def layout(self) -> ShardLayout:
        """The load balancer's layout (``layout.kind``: a cplib Layout, or
        None where SDPA cannot read it)."""
        return shard_layout_of(self.load_balancer)

    def lengths(self) -> list[int]:
        n = self.mesh.size()
        cut = shard_lengths(self.seq_len, n, self.load_balancer)
        return list(cut) if cut is not None else [self.seq_len // n] * n

    def local_len(self) -> int:
        return self.lengths()[self.mesh.get_local_rank()]

    def key(self) -> tuple:
        """The shard_key of this layout (what cplib.shard tags its outputs with)."""
        lb = self.load_balancer
        indices = None if lb is None else lb._generate_indices()
        return shard_key(self.group.group_name, self.mesh.size(), self.seq_len, indices)

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of ``full`` (sequence on its last dim)."""
        lb, n = self.load_balancer, self.mesh.size()
        indices = None if lb is None else lb._generate_indices()
        lengths = shard_lengths(full.shape[-1], n, lb)
        return shard_tensor(full, full.dim() - 1, self.mesh.get_local_rank(), n, indices, lengths)

    def full(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (checked by labels_in_layout) over the whole sequence."""
        if t.shape[-1] == self.seq_len:
            return t
        (whole,) = unshard(self.mesh, [t], [t.dim() - 1], self.load_balancer)
        return whole


_REGION = "the cplib.context_parallel region"

# The layout of the module-path scope this thread (a rank) is in: set for the
# duration of a forward given shards that carry their layout
# (transformers' models: cplib/integrations/transformers/scope.py).
_scope: contextvars.ContextVar[SequenceShards | None] = contextvars.ContextVar(
    "cplib_sharded_scope", default=None)


def traced_on_the_module_path(what: str) -> None:
    """NotImplementedError where a trace (``torch.compile``) reaches ``what``
    outside any region while the module path is on: a trace sees neither
    the module-path scope nor the layout a shard carries, so it cannot tell
    a shard from a whole sequence. A region is seen (its dispatch mode)."""
    if torch.compiler.is_compiling() and active_handle() is None and dispatcher_enabled():
        raise NotImplementedError(
            f"cplib: {what} inside a torch.compile'd function on the _ContextParallel module "
            "path: a trace cannot see the layout its inputs were sharded in; compute it outside "
            "the compiled function (the model's logits, then cplib.loss.cross_entropy), or "
            "run the model in a cplib.context_parallel region")


def shards_of(t: Any) -> SequenceShards | None:
    """The layout ``t`` was cut in by ``_context_parallel_shard`` or
    ``cplib.shard`` (None: not one of their outputs; in a trace: unseen,
    traced_on_the_module_path)."""
    if torch.compiler.is_compiling():
        return None
    tag = sharded_as(t)
    if tag is None:
        return None
    mesh, load_balancer, seq_len, source = tag
    return SequenceShards(mesh, load_balancer, seq_len, f"the {seq_len}-token sequence that "
                          f"{source} cut (its shards carry the layout)")


@contextlib.contextmanager
def sharded_scope(shards: SequenceShards) -> Iterator[None]:
    """Code inside runs under ``shards``' layout (unless a region is open)."""
    token = _scope.set(shards)
    try:
        yield
    finally:
        _scope.reset(token)


def layout_in_scope() -> SequenceShards | None:
    """The module-path scope's layout (None: none open; in a trace: unseen,
    traced_on_the_module_path)."""
    return None if torch.compiler.is_compiling() else _scope.get()


def layout_source() -> str | None:
    """Where the layout in effect comes from, in words (None: no context
    parallelism): what a loss or a model that cannot run sharded names as it
    refuses."""
    if active_handle() is not None:
        return _REGION
    shards = layout_in_scope()
    return None if shards is None else shards.source


def sequence_shards(local_len: int) -> SequenceShards | None:
    """The layout in effect (None: no context parallelism); ``local_len``,
    this rank's logits' length, gives the length of equal shards."""
    handle = active_handle()
    if handle is not None:
        seq_len = handle.config.seq_len or getattr(handle.load_balancer, "seq_length", None)
        if seq_len is None:  # equal sequential shards
            seq_len = local_len * handle.mesh.size()
        return SequenceShards(handle.mesh, handle.load_balancer, seq_len, _REGION)
    return layout_in_scope()


def _check(shards: SequenceShards | None, logits: torch.Tensor, labels: torch.Tensor,
           what: str) -> None:
    if logits.dim() < 2 or labels.shape[:-1] != logits.shape[:-2]:
        raise ValueError(
            f"cplib: {what} (..., S) must have the batch dims of logits (..., S, vocab); "
            f"logits are {tuple(logits.shape)}, {what} {tuple(labels.shape)}")
    if shards is None:
        return
    local, length = shards.local_len(), labels.shape[-1]
    if logits.shape[-2] != local:
        raise ValueError(
            f"cplib: logits have {logits.shape[-2]} positions, but this rank's shard of the "
            f"{shards.seq_len}-token sequence of {shards.source} has {local}")
    tag = shards_of(labels)
    if length == local and shards.seq_len != local and tag is not None \
            and tag.key() != shards.key():
        raise ValueError(
            f"cplib: {what} were sharded by cplib in another layout than {shards.source}; "
            "shard them with the inputs (the same mesh, load balancer and length)")
    if length not in (local, shards.seq_len):
        raise ValueError(
            f"cplib: {what} has {length} positions, but under {shards.source} this rank's "
            f"logits have {local} and the sequence {shards.seq_len}: shard {what} with the "
            f"inputs (list {what} among the context's buffers, seq dim 1), or pass the full, "
            "unsharded tensor")


# Runs eagerly inside a compiled model: traced, in the frame dynamo resumes
# after a graph break in the loss, ``logits.shape[-2]`` raised "TypeError:
# 'int' object is not subscriptable" (torch 2.13); the layout lookup and the
# label gather are host work and collectives besides.
@torch.compiler.disable
def labels_in_layout(logits: torch.Tensor, labels: torch.Tensor,
                     what: str = "labels") -> tuple[SequenceShards | None, torch.Tensor]:
    """(the layout in effect, ``labels`` over the whole sequence); without
    context parallelism (None, labels). The layout is the scope's
    (:func:`sequence_shards`), else the one ``labels`` were cut in
    (:func:`shards_of`). Bad input (shapes; labels of another length or
    sharded in another layout) raises ValueError on every rank, before any
    collective."""
    shards = sequence_shards(logits.shape[-2]) if logits.dim() >= 2 else None
    if shards is None:
        shards = shards_of(labels)

    def check() -> None:
        _check(shards, logits, labels, what)

    group = None if shards is None else shards.group.group_name
    agreed("loss", group, [logits, labels], check)
    return shards, (labels if shards is None else shards.full(labels))
