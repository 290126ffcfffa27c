"""Sharding buffers along the sequence for context parallelism and putting
them back together.

A shard is this rank's contiguous ``1/N`` of the (optionally load-balancer
rearranged) sequence. Sharding needs no communication: every rank holds the
full buffer (same data, e.g. the same batch), as with torch's
``distribute_tensor(..., src_data_rank=None)``.

Any length S >= N shards without padding when there is no load balancer or
it is an ``AnyLengthHeadTailLoadBalancer``: shard lengths then differ by at
most one token per chunk (``cplib.attention.layout``); for lengths that divide,
the cut is ``torch.chunk``'s.
"""

from __future__ import annotations

import contextlib
import weakref
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..ring.load_balancer import _LoadBalancer, rearrange, shard_lengths
from ..comm.handshake import agreed, handshake
from ..comm.native import check_mesh
from .options import _cp_options
from .start_hooks import run_start_hooks

__all__ = ["_context_parallel_shard", "shard"]


def _check_seq_dim(t: torch.Tensor, seq_dim: int, what: str) -> int:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"cplib: {what} must be a torch.Tensor, got {type(t).__name__}")
    if isinstance(seq_dim, bool) or not isinstance(seq_dim, int):
        raise ValueError(f"cplib: the seq_dim of {what} must be an int, got {seq_dim!r} "
                         f"({type(seq_dim).__name__})")
    if t.ndim == 0 or not -t.ndim <= seq_dim < t.ndim:
        raise ValueError(
            f"cplib: {what} has shape {tuple(t.shape)}; its seq_dim {seq_dim} is out of range"
        )
    return seq_dim % t.ndim


def check_shardable(buffers: Sequence[torch.Tensor], seq_dims: Sequence[int], world_size: int,
                    what: str = "buffer", any_length: bool = False) -> None:
    """Everything that can go wrong when sharding, checked from shapes alone
    (so every rank raises the same ValueError before any communication)."""
    if len(buffers) != len(seq_dims):
        raise ValueError(
            f"cplib: got {len(buffers)} {what}s but {len(seq_dims)} sequence dims; "
            "seq_dims must have one entry per buffer"
        )
    device = None
    for i, (b, d) in enumerate(zip(buffers, seq_dims)):
        dim = _check_seq_dim(b, d, f"{what} {i}")
        length = b.shape[dim]
        if any_length and length < world_size:
            raise ValueError(
                f"cplib: {what} {i} has sequence length {length} (shape {tuple(b.shape)}, "
                f"seq_dim {d}), shorter than the context-parallel world size {world_size}"
            )
        if not any_length and length % world_size:
            raise ValueError(
                f"cplib: {what} {i} has sequence length {length} (shape {tuple(b.shape)}, "
                f"seq_dim {d}), not divisible by the context-parallel world size {world_size}"
            )
        if device is None:
            device = b.device
        elif b.device != device:
            raise ValueError(f"cplib: all {what}s must be on one device; {what} {i} is on "
                             f"{b.device}, {what} 0 on {device}")


def shard_tensor(t: torch.Tensor, seq_dim: int, rank: int, world_size: int,
                 indices: torch.Tensor | None,
                 lengths: Sequence[int] | None = None) -> torch.Tensor:
    """This rank's shard of ``t`` as a fresh contiguous tensor: equal parts,
    or ``lengths[r]`` rows for rank r of the (rearranged) sequence."""
    if indices is not None:
        t = rearrange(t, seq_dim, indices)
    if lengths is None:
        return t.chunk(world_size, seq_dim)[rank].contiguous()
    return t.narrow(seq_dim, sum(lengths[:rank]), lengths[rank]).contiguous()


def _any_length(load_balancer: _LoadBalancer | None) -> bool:
    from ..ring.load_balancer import AnyLengthHeadTailLoadBalancer, AnyLengthPerDocumentLoadBalancer

    return load_balancer is None or callable(getattr(load_balancer, "lengths", None)) or \
        isinstance(load_balancer, (AnyLengthHeadTailLoadBalancer, AnyLengthPerDocumentLoadBalancer))


def _block_mask_type() -> type | None:
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError:  # pragma: no cover - torch without flex attention
        return None
    return BlockMask


def check_load_balancer(load_balancer) -> None:
    if load_balancer is not None and not isinstance(load_balancer, _LoadBalancer):
        raise ValueError(f"cplib: load_balancer must be a cplib load balancer or None, got "
                         f"{type(load_balancer).__name__}")


def describe_load_balancer(load_balancer: _LoadBalancer | None) -> dict[str, int]:
    """The handshake fields of a load balancer: its kind, sequence length
    and, for the document placement, a hash of the placement."""
    kind = 0 if load_balancer is None else zlib.crc32(type(load_balancer).__name__.encode())
    fields = {"load_balancer (kind)": kind,
              "load_balancer.seq_length": int(getattr(load_balancer, "seq_length", -1) or -1)}
    # A layout computed from data (the document placement) is compared too.
    extra = getattr(load_balancer, "handshake_fields", None)
    fields.update(extra() if callable(extra) else {"document placement (hash)": -1})
    return fields


def shard_key(group_name: str, world_size: int, seq_len: int,
              indices: torch.Tensor | None) -> tuple:
    """What tells one layout of a ``seq_len`` sequence from another: the
    group, its size and the permutation the load balancer applies (None:
    sequential), hashed."""
    perm = 0 if indices is None else zlib.crc32(indices.cpu().contiguous().numpy().tobytes())
    return (group_name, world_size, seq_len, perm)


# The attribute :func:`shard` sets on each shard it returns: _ShardedAs. The
# sharded tensors carry their own layout (DESIGN.md section 15): on the module
# path, where no region says what is context parallel, a loss or a model
# given one of them reads the layout there, and nothing is recorded for later
# calls to match.
SHARDED_ATTR = "_cplib_sharded"


class _ShardedAs:
    """Where a shard came from, without holding its group: a tensor the user
    keeps must not keep a process group alive past destroy_process_group()
    (comm.md). The mesh is held weakly and found again by its group's name."""

    def __init__(self, mesh: DeviceMesh, load_balancer: Any, seq_len: int, source: str):
        self._mesh = weakref.ref(mesh)
        self._group_name = check_mesh(mesh).group_name
        self._device_type = mesh.device_type
        self.load_balancer, self.seq_len, self.source = load_balancer, seq_len, source

    def mesh(self) -> DeviceMesh:
        mesh = self._mesh()
        if mesh is None:  # the user let go of the mesh, not of the group
            from torch.distributed.distributed_c10d import _resolve_process_group

            mesh = DeviceMesh.from_group(_resolve_process_group(self._group_name),
                                         self._device_type)
            self._mesh = weakref.ref(mesh)
        return mesh


def sharded_as(t: Any) -> tuple | None:
    """(mesh, load_balancer, seq_len, source) of the layout :func:`shard` cut
    ``t`` in (None: not one of its outputs, or a copy of one)."""
    tag = getattr(t, SHARDED_ATTR, None) if isinstance(t, torch.Tensor) else None
    return None if tag is None else (tag.mesh(), tag.load_balancer, tag.seq_len, tag.source)


def _shard_block_mask(mesh: DeviceMesh, mask: Any, load_balancer: _LoadBalancer | None) -> Any:
    from ..flex.block_mask import shard_block_mask as shard_flex_mask  # needs flex attention
    return shard_flex_mask(mesh, mask, load_balancer)


class ShardPack:
    """The pack hook of :func:`keep_shards_for_backward`. Its type marks the
    region's hooks: they are not a checkpoint's, so a call made under them
    is not recomputed in the backward (mode_kept.may_be_recomputed), and a
    backward that builds no graph runs without them
    (mode_kept.autograd_past_shard_hooks)."""

    def __init__(self, storages: set[int]) -> None:
        self.storages = storages

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.storages:
            return t
        return t.new_empty(0).set_(storage, t.storage_offset(), t.size(), t.stride())


def keep_shards_for_backward(shards: list[torch.Tensor]):
    """Autograd saves the buffers themselves (an embedding's ids, a linear
    layer's input), and restoring them in place on exit would make a
    backward() after the block see the full tensors (autograd's "modified by
    an inplace operation"). A tensor saved while this is active that lives in
    a shard's storage is saved as a fresh alias of that storage instead, which
    the restore leaves alone: backward after exit gets the right gradients.
    Entered before the region's dispatch mode, whose handler its setup's
    tensor calls would otherwise go through (host work)."""
    storages = {s.untyped_storage().data_ptr() for s in shards if s.numel()}
    if not storages:
        return contextlib.nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(ShardPack(storages), lambda t: t)


def shard(mesh: DeviceMesh, buffers: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
          seq_dims: Sequence[int] | Mapping[str, int],
          load_balancer: _LoadBalancer | None = None, *, _source: str = "cplib.shard") -> Any:
    """Returns this rank's shard of every buffer (same container structure).

    ``load_balancer`` (e.g. ``_HeadTailLoadBalancer(S, N, device)``) rearranges
    each buffer before it is cut; ``None`` cuts the sequence as it is. No
    communication; no global option is touched.
    """
    group = check_mesh(mesh)
    flat, spec = tree_flatten(buffers)
    flat_dims, dims_spec = tree_flatten(seq_dims)
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    block_mask = _block_mask_type()
    tensors = [(i, b, d) for i, (b, d) in enumerate(zip(flat, flat_dims))
               if not (block_mask is not None and isinstance(b, block_mask))]

    def check():
        if len(buffers) != len(seq_dims) or len(flat) != len(flat_dims):
            raise ValueError(
                f"cplib: seq_dims must have the same structure as buffers; got {len(flat)} "
                f"buffers and {len(flat_dims)} seq_dims"
            )
        check_load_balancer(load_balancer)
        check_shardable([b for _, b, _ in tensors], [d for _, _, d in tensors], n,
                        any_length=_any_length(load_balancer))
        if load_balancer is None:
            return None
        indices = load_balancer._generate_indices()
        for i, b, d in tensors:
            if b.shape[d] != indices.shape[-1]:
                raise ValueError(
                    f"cplib.shard: buffer {i} has length {b.shape[d]} along seq_dim {d} (shape "
                    f"{tuple(b.shape)}), but the load balancer rearranges a sequence of "
                    f"seq_length={indices.shape[-1]}")
        return indices

    indices = agreed("shard", group.group_name, [b for _, b, _ in tensors], check)
    handshake(group.group_name, "shard", {f"buffer {i}": b for i, b, _ in tensors},
              {**{f"seq_dims[{i}]": d % b.ndim for i, b, d in tensors},
               **describe_load_balancer(load_balancer)})
    out = list(flat)
    for i, b, d in tensors:
        lengths = shard_lengths(b.shape[d], n, load_balancer)
        out[i] = shard_tensor(b, d, rank, n, indices, lengths)
        # Which layout cut it (sharded_as): what a loss or a model given it reads.
        setattr(out[i], SHARDED_ATTR, _ShardedAs(mesh, load_balancer, b.shape[d], _source))
    for i, b in enumerate(flat):
        if block_mask is not None and isinstance(b, block_mask):
            out[i] = _shard_block_mask(mesh, b, load_balancer)
    return tree_unflatten(out, spec)


def _context_parallel_shard(mesh: DeviceMesh, buffers: Any, seq_dims: Any,
                            load_balancer: _LoadBalancer | None = None) -> Any:
    """torch's ``_context_parallel_shard``: shards like :func:`shard` and, as
    torch does, records in ``_cp_options.enable_load_balance`` whether a load
    balancer was used, which ``_ContextParallel`` SDPA modules then follow
    (and in ``_cp_options.shard_layout`` its kind, which they check how they
    read their inputs against inside their forward: shard_layout.py). The
    layout a loss or a model reads travels on the shards (:func:`sharded_as`)."""
    from .shard_layout import shard_layout_of

    run_start_hooks()  # local: cplib's integrations in place (start_hooks.py)
    result = shard(mesh, buffers, seq_dims, load_balancer, _source="_context_parallel_shard")
    _cp_options.enable_load_balance = load_balancer is not None
    _cp_options.shard_layout = shard_layout_of(load_balancer)._replace(load_balancer=load_balancer)
    return result
