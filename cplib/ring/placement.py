"""The document placement: a load balancer for packed documents that keeps
documents whole on one rank where the balance allows and cuts, head-tail,
only those it must.

The placement is computed in one place, the C core
(csrc/core/placement.c, reached through ``cplib_c::document_placement``),
which the ring also calls when ``ring_sdpa(..., placement=True)``: the
shards a balancer cuts and the ring's layout cannot disagree. Every rank
computes the same placement from the same ``cu_seqlens`` (integer
arithmetic), and the handshakes of ``shard``, ``unshard`` and the ring
compare a hash of it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..comm.native import ops
from ..attention.layout import chunk_range
from .load_balancer import _check_count, _LoadBalancer, document_bounds, inverse_permutation

__all__ = ["DocumentPlacementLoadBalancer", "document_placement"]


def document_placement(cu_seqlens: Sequence[int], world_size: int) -> list[list[tuple[int, int]]]:
    """Every rank's pieces ``(start, length)`` of the sequence, in local
    order (by global start), under the document placement of
    ``cu_seqlens`` (``[0, s1, ..., S]``) over ``world_size`` ranks. Each
    piece lies inside one document; rank r holds ``chunk_range(S, N, r)``'s
    number of tokens (S / N, the first S % N ranks one more)."""
    bounds = document_bounds(cu_seqlens)
    _check_count("world_size", world_size, 1)
    flat = ops.document_placement(bounds, world_size)
    pieces: list[list[tuple[int, int]]] = [[] for _ in range(world_size)]
    for i in range(0, len(flat), 3):
        pieces[flat[i]].append((flat[i + 1], flat[i + 2]))
    return pieces


class DocumentPlacementLoadBalancer(_LoadBalancer):
    """Places the documents of a packed sequence (``cu_seqlens``, the same
    for every batch row) across ``world_size`` ranks:

    * every rank gets the same number of tokens (S / N; for S that N does
      not divide, the first S % N ranks one more, as ``torch.tensor_split``);
    * a document the balance does not need to cut stays whole on one rank,
      so its keys and values never travel; the ring then exchanges only the
      rows of the documents that span ranks;
    * a document that must be cut (longer than a shard, or needed to even
      out the work) is cut head-tail: each of its ranks holds a front chunk
      and the mirrored back chunk, which costs the same causal work per
      token wherever the cut falls;
    * the causal work (query-key pairs) per rank is balanced: head-tail over
      the documents ordered by length (the longest first), each rank's
      share chosen for equal work, a cut moved onto a document boundary
      where that keeps the work within 2% (so at most 2 (N - 1) documents
      are cut).

    ``_generate_indices(restore=False)`` gives the ``(1, S)`` permutation
    (its inverse with ``restore=True``) that ``shard`` / ``unshard`` /
    ``_context_parallel_shard`` / the flex path apply; :meth:`lengths` every
    rank's token count. Attention on such shards takes
    ``ring_sdpa(..., cu_seqlens=..., seq_len=S, placement=True)``, or
    ``context_parallel(..., load_balance="placement")`` with the documents.
    """

    def __init__(self, cu_seqlens: Sequence[int] | Tensor, world_size: int,
                 device: str | torch.device):
        self.cu_seqlens = document_bounds(cu_seqlens)
        self.world_size = _check_count("world_size", world_size, 1)
        self.seq_length = self.cu_seqlens[-1]
        if self.seq_length < world_size:
            raise ValueError(f"cplib: the sequence length {self.seq_length} is shorter than the "
                             f"world size {world_size} (every rank needs a token)")
        self.device = device
        self._pieces: list[list[tuple[int, int]]] | None = None

    def pieces(self) -> list[list[tuple[int, int]]]:
        """Every rank's ``(start, length)`` pieces, in local order."""
        if self._pieces is None:
            self._pieces = document_placement(self.cu_seqlens, self.world_size)
        return self._pieces

    def lengths(self) -> list[int]:
        return [chunk_range(self.seq_length, self.world_size, r)[1]
                for r in range(self.world_size)]

    def _generate_indices(self, restore: bool = False) -> Tensor:
        perm = torch.cat([torch.arange(s, s + n, device=self.device)
                          for rank in self.pieces() for s, n in rank])
        return (inverse_permutation(perm) if restore else perm).unsqueeze(0)

    def handshake_fields(self) -> dict[str, int]:
        """What ranks must agree on beyond the kind and length: the placement."""
        from ..comm.handshake import values_hash

        flat = [x for r, rank in enumerate(self.pieces()) for p in rank for x in (r, *p)]
        return {"document placement (hash)": values_hash(flat)}
