"""Where a sequence-mixing layer's tokens live under context parallelism:
every rank's pieces of the global sequence, in the context's layout.

Recurrences and causal convolutions read the sequence in order, so each
piece needs what comes before it: the last ``k - 1`` inputs for a conv
(halo), the recurrent state for a recurrence. Two layouts are supported:
sequential shards (rank r holds chunk r of N) and head-tail shards (rank r
holds chunks r and 2N-1-r of 2N), any length; the others raise
NotImplementedError naming the layout, on every rank alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..attention.layout import shard_ranges
from ..attention.names import Layout, layout_words

__all__ = ["SequenceLayout", "LAYOUTS_READ_IN_ORDER"]

# The layouts recurrent and conv layers run on.
LAYOUTS_READ_IN_ORDER = (Layout.SEQUENTIAL, Layout.HEAD_TAIL)


@dataclass(frozen=True)
class SequenceLayout:
    """The sequence layout of one context: ``world_size`` ranks over
    ``group_name``, ``seq_len`` positions, in ``layout``
    (``Layout.SEQUENTIAL`` or ``Layout.HEAD_TAIL``)."""

    group_name: str
    world_size: int
    rank: int
    seq_len: int
    layout: Layout

    def __post_init__(self) -> None:
        if not isinstance(self.layout, str) or self.layout not in LAYOUTS_READ_IN_ORDER:
            raise ValueError(f"cplib: SequenceLayout's layout must be one of "
                             f"{[str(x) for x in LAYOUTS_READ_IN_ORDER]}, got {self.layout!r}")

    @property
    def head_tail(self) -> bool:
        return self.layout == Layout.HEAD_TAIL

    def pieces(self, rank: int | None = None) -> list[tuple[int, int]]:
        """(global start, length) of ``rank``'s pieces (this rank's by default),
        in local order."""
        r = self.rank if rank is None else rank
        return shard_ranges(self.seq_len, self.world_size, r, self.head_tail)

    @property
    def local_len(self) -> int:
        return sum(n for _, n in self.pieces())

    @property
    def pieces_per_rank(self) -> int:
        return 2 if self.head_tail else 1

    def first_len(self) -> int | None:
        """seq_halo's ``first_len``: the first piece's length (head-tail), or None."""
        return self.pieces()[0][1] if self.head_tail else None

    def chunk_order(self) -> list[tuple[int, int]]:
        """Every piece as (rank, local piece index), in global sequence order."""
        owners = [(start, r, i) for r in range(self.world_size)
                  for i, (start, _) in enumerate(self.pieces(r))]
        return [(r, i) for _, r, i in sorted(owners)]

    def lengths(self) -> list[int]:
        """Every rank's local length, rank order."""
        return [sum(n for _, n in self.pieces(r)) for r in range(self.world_size)]

    def check_pieces(self, what: str, minimum: int = 1) -> None:
        """ValueError (the same on every rank: from the layout alone) unless
        every rank holds ``pieces_per_rank`` pieces of at least ``minimum``
        positions each."""
        for r in range(self.world_size):
            sizes = [n for _, n in self.pieces(r)]
            if len(sizes) != self.pieces_per_rank or min(sizes) < minimum:
                raise ValueError(
                    f"cplib: {what} under context parallelism needs every "
                    f"{layout_words(self.layout)} chunk of the sequence to hold at least "
                    f"{minimum} position(s); a sequence of "
                    f"{self.seq_len} over {self.world_size} ranks gives rank {r} chunks of "
                    f"{sizes}: use a longer sequence or fewer ranks")

    @classmethod
    def of_context(cls, handle: Any, local_len: int, what: str) -> "SequenceLayout":
        """The layout of a ``cplib.context_parallel`` region (its handle) for a
        layer ``what`` whose input holds ``local_len`` positions."""
        config = handle.config
        n = handle.mesh.size()
        unsupported = None
        if config.ulysses_degree != 1:
            unsupported = f"ulysses_degree={config.ulysses_degree} (USP)"
        elif config.layout not in LAYOUTS_READ_IN_ORDER:  # load_balance names these layouts
            unsupported = f"load_balance='{config.layout}'"
        if unsupported is not None:
            raise NotImplementedError(
                f"cplib: {what} under cplib.context_parallel with {unsupported}: recurrent and "
                "convolution layers run on sequential or head-tail shards only; use "
                "load_balance=True or False with ulysses_degree=1")
        seq_len = config.seq_len if config.seq_len is not None else local_len * n
        layout = cls(config.group_name, n, handle.mesh.get_local_rank(), seq_len,
                     Layout(config.layout))
        if layout.local_len != local_len:
            raise ValueError(
                f"cplib: {what} got {local_len} positions on rank {layout.rank}, but the "
                f"context's layout gives it {layout.local_len} of {seq_len}: its input must be "
                "sharded like the context's buffers (list input_ids among them)")
        return layout
