"""Putting sharded buffers back together (``context_parallel_unshard``,
``unshard``): every rank's shard lengths are agreed in a handshake and
checked against the load balancer's layout before anything is gathered."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..comm.handshake import agreed, handshake
from ..comm.native import check_mesh
from ..ring.load_balancer import _create_default_load_balancer, _LoadBalancer, rearrange, \
    shard_lengths
from .options import _cp_options
from .sharding import _check_seq_dim, check_load_balancer, describe_load_balancer, shard_tensor

__all__ = ["context_parallel_unshard", "unshard"]


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


def _balanced_lengths(load_balancer: _LoadBalancer, indices: torch.Tensor, n: int) -> list[int]:
    """Every rank's shard length in ``load_balancer``'s layout over ``n``
    ranks; its sequence length is the length its ``indices`` permute."""
    total = int(indices.shape[-1])
    lengths = shard_lengths(total, n, load_balancer)
    if lengths is not None:
        return list(lengths)
    if total % n:
        raise ValueError(f"cplib: the load balancer's sequence length {total} cannot be cut "
                         f"into {n} equal shards")
    return [total // n] * n


def _check_layout(op: str, i: int, seq_dim: int, rank: int, expected: list[int],
                  gathered: list[int] | None, own: int) -> None:
    """ValueError naming the lengths when buffer ``i``'s shards are not the
    load balancer's layout: from every rank's lengths (the handshake's, the
    same on every rank, so every rank raises alike), else from this rank's."""
    total = sum(expected)
    if gathered is not None:
        if gathered != expected:
            raise ValueError(
                f"cplib.{op}: buffer {i}'s shards have lengths {gathered} along seq_dim "
                f"{seq_dim} (rank order, {sum(gathered)} in all), but the load balancer's "
                f"layout of seq_length={total} over {len(expected)} ranks needs {expected}")
    elif own != expected[rank]:
        raise ValueError(
            f"cplib.{op}: buffer {i} has length {own} along seq_dim {seq_dim} on rank {rank}, "
            f"but the load balancer's layout of seq_length={total} over {len(expected)} ranks "
            f"gives it {expected[rank]} (all ranks: {expected})")


def _layout(group: dist.ProcessGroup, t: torch.Tensor, seq_dim: int,
            expected: list[int] | None, gathered: list[int] | None) -> list[int] | None:
    """Shard lengths of ``t``'s layout, or None when they are all equal:
    ``expected`` (a load balancer's, already checked), else ``gathered``
    (every rank's length of ``t``, from the handshake), else gathered now."""
    lengths = expected
    if lengths is None:
        lengths = gathered if gathered is not None else _gathered_lengths(t, seq_dim, group)
    return None if len(set(lengths)) == 1 else lengths


def _default_restore_indices(mesh: DeviceMesh, length: int,
                             device: torch.device) -> torch.Tensor | None:
    # As torch: without an explicit balancer, follow the global option.
    from ..ulysses.usp_layout import active_ulysses_degree  # USP: head-tail over the ring degree

    balancer = _create_default_load_balancer(length, mesh.size() // active_ulysses_degree(),
                                             device, _cp_options.enable_load_balance)
    return balancer._generate_indices(restore=True) if balancer else None


@dataclass
class _UnshardPlan:
    """What unshard needs after its checks and handshake (every rank alike)."""

    group: dist.ProcessGroup
    dims: list[int]  # each buffer's seq dim, normalised
    layouts: list[list[int] | None]  # each buffer's shard lengths; None: equal
    forward: torch.Tensor | None  # the load balancer's indices, and their inverse
    restore: torch.Tensor | None


def _check_unshard(op: str, mesh: DeviceMesh, buffers: Sequence[torch.Tensor],
                   seq_dims: Sequence[int],
                   load_balancer: _LoadBalancer | None) -> _UnshardPlan:
    """The checks, the handshake (which carries every rank's lengths) and the
    layout of every buffer, before any collective that trusts it: a bad
    argument, ranks that disagree, or shard lengths that are not the load
    balancer's layout raise the same error on every rank."""
    group = check_mesh(mesh)
    n, rank = dist.get_world_size(group), dist.get_rank(group)

    def check():
        if len(buffers) != len(seq_dims):
            raise ValueError(f"cplib: got {len(buffers)} buffers but {len(seq_dims)} seq_dims")
        for i, (b, d) in enumerate(zip(buffers, seq_dims)):
            _check_seq_dim(b, d, f"buffer {i}")
        check_load_balancer(load_balancer)
        if load_balancer is None:
            return None, None, None
        forward = load_balancer._generate_indices()
        return forward, load_balancer._generate_indices(restore=True), \
            _balanced_lengths(load_balancer, forward, n)

    forward, restore, expected = agreed(op, group.group_name, list(buffers), check)
    dims = [d % b.ndim for b, d in zip(buffers, seq_dims)]
    # Shards may differ in length: the description leaves it out (a view of
    # no rows) and the lengths travel as the call's local lengths.
    table = handshake(group.group_name, op,
                      {f"buffer {i}": b.narrow(d, 0, 0) for i, (b, d) in enumerate(zip(buffers,
                                                                                         dims))},
                      {**{f"seq_dims[{i}]": d for i, d in enumerate(dims)},
                       **describe_load_balancer(load_balancer)},
                      [b.shape[d] for b, d in zip(buffers, dims)])
    layouts = []
    for i, (b, d) in enumerate(zip(buffers, dims)):
        gathered = None if table is None else [row[i] for row in table]
        if expected is not None:
            _check_layout(op, i, d, rank, expected, gathered, b.shape[d])
        layouts.append(_layout(group, b, d, expected, gathered))
    return _UnshardPlan(group, dims, layouts, forward, restore)


@torch.no_grad()
def context_parallel_unshard(mesh: DeviceMesh, buffers: list[torch.Tensor], seq_dims: list[int],
                             load_balancer: _LoadBalancer | None = None) -> list[torch.Tensor]:
    """Gathers sharded tensors (outputs, gradients) back into full sequences:
    the exact inverse of the sharding. Without ``load_balancer`` the layout
    follows ``_cp_options.enable_load_balance`` (head-tail when the length
    divides evenly), as in torch. Not differentiable: see :func:`unshard`.
    Shards whose lengths are not ``load_balancer``'s layout (every rank's
    length is compared, after the handshake) raise the same ValueError on
    every rank, before any communication."""
    if not buffers:
        return []
    plan = _check_unshard("context_parallel_unshard", mesh, buffers, seq_dims, load_balancer)
    out = []
    for b, d, lengths in zip(buffers, plan.dims, plan.layouts):
        if load_balancer is not None:
            restore = plan.restore
        else:
            total = sum(lengths) if lengths is not None else b.shape[d] * mesh.size()
            restore = _default_restore_indices(mesh, total, b.device)
        full = _gather(b.contiguous(), d, plan.group, lengths)
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
    so gradients of replicated parameters are then summed over the group.
    Shard lengths are checked as in :func:`context_parallel_unshard`."""
    if not buffers:
        return []
    plan = _check_unshard("unshard", mesh, buffers, seq_dims, load_balancer)
    return [_Unshard.apply(b, d, plan.group, plan.restore, plan.forward, lengths)
            for b, d, lengths in zip(buffers, plan.dims, plan.layouts)]
