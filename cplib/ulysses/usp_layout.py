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
on different heads. For lengths divisible by 2N it is exactly
``_HeadTailLoadBalancer(S, R)`` followed by the ordinary N-way cut;
``shard``/``unshard`` take it as ``usp_load_balancer``, and with U = 1 it
is the ring's layout.

Any length, documents. In general the ring layout is ``cplib.attention.layout``'s
over R positions (sequential, head-tail, or head-tail inside every document,
for any S >= R) and ring shard i (L_i rows) is cut into U pieces of
``chunk_range(L_i, U, j)`` rows, piece j on rank i*U + j. When S divides
evenly this is the layout above. ``usp_shard_ranges`` is the one definition:
``UspLoadBalancer`` (shard/unshard) and ``usp_sdpa`` (which pads the pieces
of a ring shard to one length for the exchange) both read it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..comm.native import group_token
from ..ring.load_balancer import _LoadBalancer, inverse_permutation
from ..attention.layout import chunk_range, shard_ranges

__all__ = ["UspGroups", "UspLoadBalancer", "check_degrees", "usp_groups", "usp_load_balancer",
           "usp_piece_lengths", "usp_shard_ranges", "active_ulysses_degree", "ulysses_layout"]


def check_degrees(world_size: int, ulysses_degree: int) -> int:
    """The ring degree N / U; ValueError (same on every rank) unless U divides N."""
    if isinstance(ulysses_degree, bool) or not isinstance(ulysses_degree, int) \
            or ulysses_degree < 1:
        raise ValueError(f"cplib: ulysses_degree must be a positive int, got {ulysses_degree!r}")
    if world_size % ulysses_degree:
        raise ValueError(f"cplib: ulysses_degree={ulysses_degree} does not divide the "
                         f"context-parallel world size {world_size}")
    return world_size // ulysses_degree


def usp_piece_lengths(seq_len: int, ring_degree: int, ulysses_degree: int, ring_rank: int,
                      head_tail: bool, documents: list[int] | None = None) -> list[int]:
    """The rows of the U pieces of ring shard ``ring_rank``, in Ulysses-rank order."""
    total = sum(n for _, n in shard_ranges(seq_len, ring_degree, ring_rank, head_tail, documents))
    return [chunk_range(total, ulysses_degree, j)[1] for j in range(ulysses_degree)]


def usp_shard_ranges(seq_len: int, world_size: int, ulysses_degree: int, rank: int,
                     head_tail: bool, documents: list[int] | None = None
                     ) -> list[tuple[int, int]]:
    """The (start, length) global pieces of ``rank``'s USP shard, in local
    order: its Ulysses piece of its ring position's shard."""
    ring_degree = check_degrees(world_size, ulysses_degree)
    ring_rank, j = divmod(rank, ulysses_degree)
    ring = shard_ranges(seq_len, ring_degree, ring_rank, head_tail, documents)
    first, count = chunk_range(sum(n for _, n in ring), ulysses_degree, j)
    pieces = []
    for start, n in ring:  # the rows [first, first + count) of the ring shard
        lo, hi = max(first, 0), min(first + count, n)
        if lo < hi:
            pieces.append((start + lo, hi - lo))
        first -= n
    return pieces


class UspLoadBalancer(_LoadBalancer):
    """The USP layout as a load balancer for ``shard``, ``unshard`` and
    ``_context_parallel_shard``: ring layout over N / U positions (head-tail
    with ``head_tail``, inside every document with ``documents``), each ring
    shard cut into U pieces. Any length S >= N; shards may differ by a row."""

    def __init__(self, seq_length: int, world_size: int, ulysses_degree: int,
                 device: str | torch.device = "cpu", *, head_tail: bool = True,
                 documents: list[int] | None = None):
        self.seq_length = seq_length
        self.world_size = world_size
        self.ulysses_degree = ulysses_degree
        self.device = device
        self.head_tail = head_tail or documents is not None
        self.documents = None if documents is None else [int(x) for x in documents]
        lengths = self.lengths()
        if min(lengths) < 1:
            raise ValueError(
                f"cplib: sequence length {seq_length} over {world_size} ranks with "
                f"ulysses_degree={ulysses_degree} leaves a rank without a token (shard lengths "
                f"{lengths}); use a longer sequence or a smaller world")

    def ranges(self, rank: int) -> list[tuple[int, int]]:
        return usp_shard_ranges(self.seq_length, self.world_size, self.ulysses_degree, rank,
                                self.head_tail, self.documents)

    def lengths(self) -> list[int]:
        return [sum(n for _, n in self.ranges(r)) for r in range(self.world_size)]

    def _generate_indices(self, restore: bool = False) -> torch.Tensor:
        perm = torch.cat([torch.arange(s, s + n, device=self.device)
                          for r in range(self.world_size) for s, n in self.ranges(r)])
        return (inverse_permutation(perm) if restore else perm).unsqueeze(0)


def usp_load_balancer(seq_length: int, world_size: int, ulysses_degree: int,
                      device: str | torch.device = "cpu", *, head_tail: bool = True,
                      cu_seqlens: torch.Tensor | list[int] | None = None) -> UspLoadBalancer:
    """The load balancer of the USP layout (pass it to ``shard``, ``unshard``,
    ``_context_parallel_shard``): head-tail over the ring degree N / U (the
    layout of ``load_balanced=True``; ``head_tail=False``: sequential, for
    uneven lengths), or head-tail inside every document of ``cu_seqlens``
    (``per_document=True``). Any length S >= N."""
    check_degrees(world_size, ulysses_degree)
    if seq_length < world_size:
        raise ValueError(f"cplib: sequence length {seq_length} is shorter than the "
                         f"context-parallel world size {world_size}")
    documents = None
    if cu_seqlens is not None:
        documents = [int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor)
                                      else cu_seqlens)]
        if documents[-1] != seq_length:
            raise ValueError(f"cplib: cu_seqlens ends at {documents[-1]}, not at the sequence "
                             f"length {seq_length}")
    return UspLoadBalancer(seq_length, world_size, ulysses_degree, device, head_tail=head_tail,
                           documents=documents)


@dataclass(frozen=True)
class UspGroups:
    """The names of this rank's Ulysses group and ring group; None for a
    degree of 1 (no such group: pure ring or pure Ulysses), and the CP group
    itself for a degree of N."""

    ulysses_group: str | None
    ring_group: str | None
    ulysses_degree: int
    ring_degree: int


# By (group token, degree): torch reuses group names after destroy_process_group
# and a new init (cplib/comm/native.py: group_token).
_cache: dict[tuple[int, int], UspGroups] = {}


def usp_groups(group: dist.ProcessGroup, ulysses_degree: int) -> UspGroups:
    """This rank's Ulysses and ring groups within ``group``, made once per
    (group, degree): the first call is collective over ``group`` (every rank
    calls it, as ``context_parallel`` and ``_ContextParallel`` do)."""
    n = dist.get_world_size(group)
    ring_degree = check_degrees(n, ulysses_degree)
    key = (group_token(group), ulysses_degree)
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
