"""USP: the 2-D split of a context-parallel group of N ranks into
ring_degree R x ulysses_degree U, and the one sequence layout it needs.

Ranks are numbered by their rank in the CP group. Ulysses groups are U
consecutive ranks (rank p is Ulysses rank p % U of group p // U); ring groups
are the ranks with the same Ulysses rank (ring position p // U).

Layout. The sequence is permuted for the ring dimension (head-tail over R
ring positions when load balanced: 2R chunks, ring position i holds chunks i
and 2R-1-i; identity otherwise) and then cut into N equal consecutive
pieces, piece p on rank p. So each Ulysses group's U pieces are, in rank
order, its ring shard in the order ring attention expects, which the first
all-to-all assembles on every rank of the group; causal work is then even
over the ring positions, and within a group every rank does the same work
on different heads. It is exactly ``_HeadTailLoadBalancer(S, R)`` followed by
the ordinary N-way cut, so ``shard``/``unshard`` take that balancer
(``usp_load_balancer``), and with U = 1 it is today's ring layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ._load_balancer import _HeadTailLoadBalancer

__all__ = ["UspGroups", "check_degrees", "usp_groups", "usp_load_balancer",
           "active_ulysses_degree", "ulysses_layout"]


def check_degrees(world_size: int, ulysses_degree: int) -> int:
    """The ring degree N / U; ValueError (same on every rank) unless U divides N."""
    if isinstance(ulysses_degree, bool) or not isinstance(ulysses_degree, int) \
            or ulysses_degree < 1:
        raise ValueError(f"cplib: ulysses_degree must be a positive int, got {ulysses_degree!r}")
    if world_size % ulysses_degree:
        raise ValueError(f"cplib: ulysses_degree={ulysses_degree} does not divide the "
                         f"context-parallel world size {world_size}")
    return world_size // ulysses_degree


def usp_load_balancer(seq_length: int, world_size: int, ulysses_degree: int,
                      device: str | torch.device = "cpu") -> _HeadTailLoadBalancer:
    """The load balancer of the USP layout: head-tail over the ring degree
    N / U (pass it to ``shard``, ``unshard``, ``_context_parallel_shard``)."""
    ring_degree = check_degrees(world_size, ulysses_degree)
    if seq_length % world_size:
        raise ValueError(f"cplib: sequence length {seq_length} is not divisible by the "
                         f"context-parallel world size {world_size}")
    return _HeadTailLoadBalancer(seq_length, ring_degree, device)


@dataclass(frozen=True)
class UspGroups:
    """The names of this rank's Ulysses group and ring group; None for a
    degree of 1 (no such group: pure ring or pure Ulysses), and the CP group
    itself for a degree of N."""

    ulysses_group: str | None
    ring_group: str | None
    ulysses_degree: int
    ring_degree: int


_cache: dict[tuple[str, int], UspGroups] = {}


def usp_groups(group: dist.ProcessGroup, ulysses_degree: int) -> UspGroups:
    """This rank's Ulysses and ring groups within ``group``, made once per
    (group, degree): the first call is collective over ``group`` (every rank
    calls it, as ``context_parallel`` and ``_ContextParallel`` do)."""
    n = dist.get_world_size(group)
    ring_degree = check_degrees(n, ulysses_degree)
    key = (group.group_name, ulysses_degree)
    found = _cache.get(key)
    if found is not None:
        return found
    if ulysses_degree == 1:
        found = UspGroups(None, group.group_name, ulysses_degree, ring_degree)
    elif ring_degree == 1:
        found = UspGroups(group.group_name, None, ulysses_degree, ring_degree)
    else:
        found = _make_subgroups(group, n, ulysses_degree, ring_degree)
    _cache[key] = found
    return found


def _make_subgroups(group: dist.ProcessGroup, n: int, u: int, r: int) -> UspGroups:
    members = dist.get_process_group_ranks(group)  # global ranks in CP-rank order
    me = dist.get_rank(group)
    ulysses = [[members[i * u + j] for j in range(u)] for i in range(r)]
    rings = [[members[i * u + j] for i in range(r)] for j in range(u)]
    mine = (ulysses[me // u], rings[me % u])
    if n == dist.get_world_size():
        # Every rank of the world creates every subgroup, in one order.
        made = {tuple(ranks): dist.new_group(ranks) for ranks in ulysses + rings}
        ug, rg = made[tuple(mine[0])], made[tuple(mine[1])]
    else:  # a slice of a larger mesh: only the members of each group meet
        ug = dist.new_group(mine[0], use_local_synchronization=True)
        rg = dist.new_group(mine[1], use_local_synchronization=True)
    return UspGroups(ug.group_name, rg.group_name, u, r)


# The Ulysses degree of the innermost active ``context_parallel`` (1 outside),
# so that ``context_parallel_unshard`` without a balancer follows its layout
# as it follows ``_cp_options.enable_load_balance``.
_active: list[int] = []


def active_ulysses_degree() -> int:
    return _active[-1] if _active else 1


class ulysses_layout:
    """Context manager recording the active context's Ulysses degree."""

    def __init__(self, degree: int):
        self.degree = degree

    def __enter__(self) -> None:
        _active.append(self.degree)

    def __exit__(self, *exc) -> None:
        _active.pop()
