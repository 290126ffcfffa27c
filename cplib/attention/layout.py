"""Where each rank's rows sit in the global sequence, for any length.

The sequence of ``S`` tokens is cut into ``C`` chunks whose sizes differ by at
most one (the first ``S % C`` chunks get the extra token). Sequential sharding
gives rank ``r`` chunk ``r`` of ``N``; head-tail sharding gives it chunks ``r``
and ``2N-1-r`` of ``2N``. For lengths that divide, this is exactly
``torch.chunk``'s split (and torch's head-tail layout); for others it keeps
the shards within one token per chunk of each other, with no padding.
Per-document head-tail sharding (``documents``: cu_seqlens) cuts every
document into 2N chunks and gives rank ``r`` chunks ``r`` and ``2N-1-r`` of
each, documents in order (the layout drawn in torch's
``_PerDocumentHeadTailLoadBalancer`` docstring, for any lengths). The C++
ring computes the same pieces (csrc/torch/ring/ring_layout.cpp).
"""

from __future__ import annotations

import torch

__all__ = ["chunk_range", "shard_ranges", "local_length", "shard_positions", "layout_indices"]


def chunk_range(seq_len: int, chunks: int, c: int) -> tuple[int, int]:
    """(start, length) of chunk ``c`` of ``chunks``."""
    base, extra = divmod(seq_len, chunks)
    return c * base + min(c, extra), base + (1 if c < extra else 0)


def shard_ranges(seq_len: int, world_size: int, rank: int, head_tail: bool,
                 documents: list[int] | None = None) -> list[tuple[int, int]]:
    """The non-empty (start, length) pieces of ``rank``'s shard, in local order."""
    if documents is not None:
        pieces = []
        for a, b in zip(documents, documents[1:]):
            for c in (rank, 2 * world_size - 1 - rank):
                start, n = chunk_range(b - a, 2 * world_size, c)
                pieces.append((a + start, n))
    elif head_tail:
        pieces = [chunk_range(seq_len, 2 * world_size, rank),
                  chunk_range(seq_len, 2 * world_size, 2 * world_size - 1 - rank)]
    else:
        pieces = [chunk_range(seq_len, world_size, rank)]
    return [p for p in pieces if p[1] > 0]


def local_length(seq_len: int, world_size: int, rank: int, head_tail: bool,
                 documents: list[int] | None = None) -> int:
    return sum(n for _, n in shard_ranges(seq_len, world_size, rank, head_tail, documents))


def shard_positions(seq_len: int, world_size: int, rank: int, head_tail: bool,
                    device: str | torch.device = "cpu",
                    documents: list[int] | None = None) -> torch.Tensor:
    """The global positions of ``rank``'s rows, in local order (1-D long)."""
    parts = [torch.arange(s, s + n, device=device)
             for s, n in shard_ranges(seq_len, world_size, rank, head_tail, documents)]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long, device=device)


def layout_indices(seq_len: int, world_size: int, head_tail: bool,
                   device: str | torch.device = "cpu",
                   documents: list[int] | None = None) -> torch.Tensor:
    """Every rank's positions, rank-major: a permutation of ``range(seq_len)``."""
    return torch.cat([shard_positions(seq_len, world_size, r, head_tail, device, documents)
                      for r in range(world_size)])
