"""Sharding buffers along the sequence for context parallelism and putting
them back together.

A shard is this rank's contiguous ``1/N`` of the (optionally load-balancer
rearranged) sequence. Sharding needs no communication: every rank holds the
full buffer (same data, e.g. the same batch), as with torch's
``distribute_tensor(..., src_data_rank=None)``.

Any length S >= N shards without padding when there is no load balancer or
it is an ``AnyLengthHeadTailLoadBalancer``: shard lengths then differ by at
most one token per chunk (``cplib.ring.layout``); for lengths that divide,
the cut is ``torch.chunk``'s.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..ring.load_balancer import (
    _create_default_load_balancer,
    _LoadBalancer,
    rearrange,
    shard_lengths,
)
from ..comm.handshake import agreed, handshake
from ..comm.native import check_mesh
from .options import _cp_options

__all__ = [
    "_context_parallel_shard",
    "context_parallel_unshard",
    "shard",
    "unshard",
]


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
    """The handshake fields of a load balancer: its kind and sequence length."""
    kind = 0 if load_balancer is None else zlib.crc32(type(load_balancer).__name__.encode())
    return {"load_balancer (kind)": kind,
            "load_balancer.seq_length": int(getattr(load_balancer, "seq_length", -1) or -1)}


def _shard_block_mask(mesh: DeviceMesh, mask: Any, load_balancer: _LoadBalancer | None) -> Any:
    from ..flex.block_mask import _shard_block_mask as shard_flex_mask  # needs flex attention
    return shard_flex_mask(mesh, mask, load_balancer)


def shard(mesh: DeviceMesh, buffers: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
          seq_dims: Sequence[int] | Mapping[str, int],
          load_balancer: _LoadBalancer | None = None) -> Any:
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
        return load_balancer._generate_indices() if load_balancer is not None else None

    indices = agreed("shard", group.group_name, [b for _, b, _ in tensors], check)
    handshake(group.group_name, "shard", {f"buffer {i}": b for i, b, _ in tensors},
              {**{f"seq_dims[{i}]": d % b.ndim for i, b, d in tensors},
               **describe_load_balancer(load_balancer)})
    out = list(flat)
    for i, b, d in tensors:
        lengths = shard_lengths(b.shape[d], n, load_balancer)
        out[i] = shard_tensor(b, d, rank, n, indices, lengths)
    for i, b in enumerate(flat):
        if block_mask is not None and isinstance(b, block_mask):
            out[i] = _shard_block_mask(mesh, b, load_balancer)
    return tree_unflatten(out, spec)


def _context_parallel_shard(mesh: DeviceMesh, buffers: Any, seq_dims: Any,
                            load_balancer: _LoadBalancer | None = None) -> Any:
    """torch's ``_context_parallel_shard``: shards like :func:`shard` and, as
    torch does, records in ``_cp_options.enable_load_balance`` whether a load
    balancer was used, which ``_ContextParallel`` SDPA modules then follow."""
    result = shard(mesh, buffers, seq_dims, load_balancer)
    _cp_options.enable_load_balance = load_balancer is not None
    return result


def _gather(t: torch.Tensor, seq_dim: int, group: dist.ProcessGroup,
            lengths: Sequence[int] | None = None) -> torch.Tensor:
    """All shards concatenated in rank order; ``lengths`` (every rank's
    length along ``seq_dim``) for uneven shards, which travel padded."""
    n = dist.get_world_size(group)
    longest = t.shape[seq_dim] if lengths is None else max(lengths)
    if t.shape[seq_dim] != longest:
        pad = list(t.shape)
        pad[seq_dim] = longest - t.shape[seq_dim]
        t = torch.cat([t, t.new_zeros(pad)], seq_dim)
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t, group=group)
    if lengths is not None:
        parts = [p.narrow(seq_dim, 0, length) for p, length in zip(parts, lengths)]
    return torch.cat(parts, seq_dim)


def _gathered_lengths(t: torch.Tensor, seq_dim: int, group: dist.ProcessGroup) -> list[int]:
    """Every rank's shard length (one small all-gather): sequential shards of
    any length need no layout information from the caller."""
    mine = torch.tensor([t.shape[seq_dim]], dtype=torch.long, device=t.device)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    return [int(p.item()) for p in parts]


def _layout(group: dist.ProcessGroup, t: torch.Tensor, seq_dim: int,
            load_balancer: _LoadBalancer | None,
            gathered: list[int] | None = None) -> list[int] | None:
    """Shard lengths of ``t``'s layout, or None when they are all equal.
    ``gathered``: every rank's length of ``t``, from the handshake."""
    n = dist.get_world_size(group)
    seq_length = getattr(load_balancer, "seq_length", None)
    if load_balancer is not None and seq_length is not None:
        return shard_lengths(seq_length, n, load_balancer)
    if load_balancer is not None:
        return None
    lengths = gathered if gathered is not None else _gathered_lengths(t, seq_dim, group)
    return None if len(set(lengths)) == 1 else lengths


def _default_restore_indices(mesh: DeviceMesh, length: int,
                             device: torch.device) -> torch.Tensor | None:
    # As torch: without an explicit balancer, follow the global option.
    from ..ulysses.usp_layout import active_ulysses_degree  # USP: head-tail over the ring degree

    balancer = _create_default_load_balancer(length, mesh.size() // active_ulysses_degree(),
                                             device, _cp_options.enable_load_balance)
    return balancer._generate_indices(restore=True) if balancer else None


def _check_unshard(op: str, mesh: DeviceMesh, buffers: Sequence[torch.Tensor],
                   seq_dims: Sequence[int],
                   load_balancer: _LoadBalancer | None) -> tuple[dist.ProcessGroup, list]:
    """The group and, per buffer, every rank's length along its seq dim
    (None per buffer when the handshake is off), after checks and the
    handshake (all ranks raise alike)."""
    group = check_mesh(mesh)

    def check():
        if len(buffers) != len(seq_dims):
            raise ValueError(f"cplib: got {len(buffers)} buffers but {len(seq_dims)} seq_dims")
        for i, (b, d) in enumerate(zip(buffers, seq_dims)):
            _check_seq_dim(b, d, f"buffer {i}")
        check_load_balancer(load_balancer)

    agreed(op, group.group_name, list(buffers), check)
    dims = [d % b.ndim for b, d in zip(buffers, seq_dims)]
    # Shards may differ in length: the description leaves it out (a view of
    # no rows) and the lengths travel as the call's local lengths.
    table = handshake(group.group_name, op,
                      {f"buffer {i}": b.narrow(d, 0, 0) for i, (b, d) in enumerate(zip(buffers,
                                                                                         dims))},
                      {**{f"seq_dims[{i}]": d for i, d in enumerate(dims)},
                       **describe_load_balancer(load_balancer)},
                      [b.shape[d] for b, d in zip(buffers, dims)])
    per_buffer = [None if table is None else [row[i] for row in table]
                  for i in range(len(buffers))]
    return group, per_buffer


@torch.no_grad()
def context_parallel_unshard(mesh: DeviceMesh, buffers: list[torch.Tensor], seq_dims: list[int],
                             load_balancer: _LoadBalancer | None = None) -> list[torch.Tensor]:
    """Gathers sharded tensors (outputs, gradients) back into full sequences:
    the exact inverse of the sharding. Without ``load_balancer`` the layout
    follows ``_cp_options.enable_load_balance`` (head-tail when the length
    divides evenly), as in torch. Not differentiable: see :func:`unshard`."""
    if not buffers:
        return []
    group, gathered = _check_unshard("context_parallel_unshard", mesh, buffers, seq_dims,
                                     load_balancer)
    out = []
    for b, d, g in zip(buffers, seq_dims, gathered):
        d = d % b.ndim
        lengths = _layout(group, b, d, load_balancer, g)
        if load_balancer is not None:
            restore = load_balancer._generate_indices(restore=True)
        else:
            total = sum(lengths) if lengths is not None else b.shape[d] * mesh.size()
            restore = _default_restore_indices(mesh, total, b.device)
        full = _gather(b.contiguous(), d, group, lengths)
        out.append(full if restore is None else rearrange(full, d, restore))
    return out


class _Unshard(torch.autograd.Function):
    """All-gather (+ restore) whose backward hands each rank the slice of the
    incoming gradient that belongs to its shard: the loss computed from the
    full sequence is taken to be the same on every rank (DTensor's
    Shard -> Replicate semantics)."""

    @staticmethod
    def forward(ctx, t, seq_dim, group, restore, forward_indices, lengths):
        ctx.seq_dim, ctx.group, ctx.indices, ctx.lengths = seq_dim, group, forward_indices, lengths
        full = _gather(t.contiguous(), seq_dim, group, lengths)
        return full if restore is None else rearrange(full, seq_dim, restore)

    @staticmethod
    def backward(ctx, grad):
        n, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return (shard_tensor(grad, ctx.seq_dim, rank, n, ctx.indices, ctx.lengths),
                None, None, None, None, None)


def unshard(mesh: DeviceMesh, buffers: Sequence[torch.Tensor], seq_dims: Sequence[int],
            load_balancer: _LoadBalancer | None = None) -> list[torch.Tensor]:
    """The inverse of :func:`shard` (``load_balancer=None``: sequential
    layout; no global option is read), and differentiable, for losses
    computed on full sequences: the backward returns to each rank the
    gradient of its own shard. The loss is taken to be the same on every rank,
    so gradients of replicated parameters are then summed over the group."""
    if not buffers:
        return []
    group, gathered = _check_unshard("unshard", mesh, buffers, seq_dims, load_balancer)
    forward = restore = None
    if load_balancer is not None:
        forward = load_balancer._generate_indices()
        restore = load_balancer._generate_indices(restore=True)
    return [_Unshard.apply(b, d % b.ndim, group, restore, forward,
                           _layout(group, b, d % b.ndim, load_balancer, g))
            for b, d, g in zip(buffers, seq_dims, gathered)]
