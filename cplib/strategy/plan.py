"""The ring's schedule, counted rather than run: for every rank and ring step,
the kernel calls the ring would make and the pairs they compute, and which
blocks travel. It mirrors csrc/torch/ring/ring_plan.cpp and ring_mask.cpp
(pieces of the layout classified as empty, full, causal diagonal or partial;
partial ones cut into tiles of 256 query rows that attend only the keys they
can see, with an explicit mask), so that windows, documents and load
imbalance cost in the model what they cost in the op.

Layouts are named: "head_tail", "sequential" and "per_document" are the
ring's own (cplib/ring/layout.py); :func:`register_layout` adds one (the
document placement balancer, say) by giving every rank's global pieces."""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass
from typing import Callable

from ..ring.layout import shard_ranges

__all__ = ["register_layout", "layout_pieces", "layout_load_balance", "StepWork", "RingSchedule",
           "ring_schedule",
           "Mask", "TILE"]

TILE = 256  # rows per masked call (kTile in ring_plan.cpp)

Ranges = list[tuple[int, int]]
LayoutFn = Callable[[int, int, int, "tuple[int, ...] | None"], Ranges]
_layouts: dict[str, LayoutFn] = {}
_load_balance: dict[str, object] = {}


def register_layout(name: str, pieces: LayoutFn, load_balance: object = None) -> None:
    """Adds a sequence layout the model can cost: ``pieces(seq_len,
    world_size, rank, documents)`` returns ``rank``'s (start, length) global
    pieces in local order. A candidate naming it in ``Candidate.layout`` is
    then costed on it (blocks no rank needs are neither computed nor sent).
    ``load_balance``: the value of ``context_parallel(load_balance=...)``
    that shards the buffers in this layout, for a choice made on entry."""
    _layouts[name] = pieces
    if load_balance is not None:
        _load_balance[name] = load_balance


def layout_load_balance(name: str) -> object:
    """``context_parallel``'s ``load_balance`` for a registered layout (None:
    keep the caller's: the built-in layouts follow it)."""
    return _load_balance.get(name)


register_layout("sequential", lambda s, n, r, docs: shard_ranges(s, n, r, False))
register_layout("head_tail", lambda s, n, r, docs: shard_ranges(s, n, r, True))
register_layout("per_document",
                lambda s, n, r, docs: shard_ranges(s, n, r, True, list(docs) if docs else None))


def layout_pieces(layout: str, seq_len: int, world_size: int, rank: int,
                  documents: tuple[int, ...] | None) -> Ranges:
    if layout not in _layouts:
        raise ValueError(f"cplib.strategy: unknown layout {layout!r}; known: {sorted(_layouts)}")
    return [p for p in _layouts[layout](seq_len, world_size, rank, documents) if p[1] > 0]


class Mask:
    """The ring's mask on global positions (ring_mask.cpp): a band of
    ``left`` keys before and ``right`` after each query, inside documents."""

    def __init__(self, seq_len: int, causal: bool, left: int, right: int,
                 documents: tuple[int, ...] | None):
        self.causal = causal
        self.left, self.right = min(left, seq_len), min(right, seq_len)
        self.bounds = list(documents) if documents and len(documents) > 2 else [0, seq_len]

    def doc_of(self, pos: int) -> int:
        return bisect.bisect_right(self.bounds, pos) - 1

    def _band_empty(self, q0: int, q1: int, k0: int, k1: int) -> bool:
        return k1 - 1 < q0 - self.left or k0 > q1 - 1 + self.right

    def classify(self, q: tuple[int, int], k: tuple[int, int]) -> str:
        (q0, ql), (k0, kl) = q, k
        q1, k1 = q0 + ql, k0 + kl
        if ql <= 0 or kl <= 0 or self._band_empty(q0, q1, k0, k1):
            return "empty"
        one_doc = True
        if len(self.bounds) > 2:
            dq0, dq1 = self.doc_of(q0), self.doc_of(q1 - 1)
            dk0, dk1 = self.doc_of(k0), self.doc_of(k1 - 1)
            if not any(not self._band_empty(max(q0, self.bounds[d]), min(q1, self.bounds[d + 1]),
                                            max(k0, self.bounds[d]), min(k1, self.bounds[d + 1]))
                       for d in range(max(dq0, dk0), min(dq1, dk1) + 1)):
                return "empty"
            one_doc = dq0 == dq1 == dk0 == dk1
        if one_doc and k0 >= q1 - 1 - self.left and k1 - 1 <= q0 + self.right:
            return "full"
        if one_doc and self.causal and q0 == k0 and ql == kl and self.left >= ql - 1:
            return "causal"
        return "partial"

    def visible_keys(self, q: tuple[int, int], k: tuple[int, int]) -> tuple[int, int]:
        (q0, ql), (k0, kl) = q, k
        lo, hi = max(k0, q0 - self.left), min(k0 + kl, q0 + ql + self.right)
        if len(self.bounds) > 2 and ql > 0:
            lo = max(lo, self.bounds[self.doc_of(q0)])
            hi = min(hi, self.bounds[self.doc_of(q0 + ql - 1) + 1])
        return lo, max(hi - lo, 0)


@dataclass
class StepWork:
    """One rank's calls at one ring step: ``pairs`` computed by unmasked
    kernels (full rectangles and causal diagonals), ``masked`` the area of
    the tiles run with an explicit mask, and the number of each kind of call."""

    pairs: float = 0.0
    masked: float = 0.0
    calls: int = 0
    masked_calls: int = 0

    def add(self, kind: str, ql: int, kl: int) -> None:
        if kind == "full":
            self.pairs += ql * kl
            self.calls += 1
        elif kind == "causal":
            self.pairs += ql * (ql + 1) / 2
            self.calls += 1
        elif kind == "partial":
            self.masked += ql * kl
            self.masked_calls += 1


def _pair_work(mask: Mask, qp: Ranges, kp: Ranges) -> StepWork:
    """The calls of one rank's q pieces against one block's pieces
    (RingPlan::plan_pair), counted."""
    work = StepWork()
    kinds = [[mask.classify(q, k) for k in kp] for q in qp]
    flat = [c for row in kinds for c in row]
    if all(c == "empty" for c in flat):
        return work
    if all(c in ("full", "empty") for c in flat):
        rows = [a for a, row in enumerate(kinds) if any(c != "empty" for c in row)]
        cols = [b for b in range(len(kp)) if any(kinds[a][b] != "empty" for a in rows)]
        if all(kinds[a][b] == "full" for a in range(rows[0], rows[-1] + 1)
               for b in range(cols[0], cols[-1] + 1)):
            work.add("full", sum(qp[a][1] for a in range(rows[0], rows[-1] + 1)),
                     sum(kp[b][1] for b in range(cols[0], cols[-1] + 1)))
            return work
    for q, row in zip(qp, kinds):
        for k, kind in zip(kp, row):
            if kind in ("full", "causal"):
                work.add(kind, q[1], k[1])
            elif kind == "partial":
                for t in range(0, q[1], TILE):
                    qt = (q[0] + t, min(TILE, q[1] - t))
                    kt = mask.visible_keys(qt, k)
                    work.add(mask.classify(qt, kt), qt[1], kt[1])
    return work


def _local_causal(mask: Mask, pieces: Ranges) -> bool:
    """[A|B] x [A|B] is exactly the causal diagonal in local order (one call)."""
    return all(mask.classify(q, k) == ("causal" if a == b else "empty" if a < b else "full")
               for a, q in enumerate(pieces) for b, k in enumerate(pieces))


@dataclass
class RingSchedule:
    """The ring over ``size`` ranks: ``offsets`` visited (0 first),
    ``work[r][s]`` what rank r computes at step s (None: it skips that
    block), and ``rows[r]`` rank r's local rows."""

    size: int
    offsets: list[int]
    work: list[list[StepWork | None]]
    rows: list[int]

    def receives(self, rank: int, step: int) -> bool:
        return self.work[rank][step] is not None


@functools.lru_cache(maxsize=256)
def ring_schedule(seq_len: int, size: int, layout: str, causal: bool, left: int, right: int,
                  documents: tuple[int, ...] | None) -> RingSchedule:
    """The counted schedule of a ring of ``size`` ranks on ``layout``."""
    mask = Mask(seq_len, causal, left, right, documents)
    pieces = [layout_pieces(layout, seq_len, size, r, documents) for r in range(size)]
    table: dict[tuple[int, int], StepWork | None] = {}
    for r in range(size):
        for d in range(size):
            src = (r - d) % size
            if d == 0 and len(pieces[r]) > 1 and _local_causal(mask, pieces[r]):
                work = StepWork()
                work.add("causal", sum(n for _, n in pieces[r]), 0)
            else:
                work = _pair_work(mask, pieces[r], pieces[src])
            table[r, d] = work if (work.calls or work.masked_calls or d == 0) else None
    offsets = [0] + [d for d in range(1, size) if any(table[r, d] is not None
                                                      for r in range(size))]
    return RingSchedule(size, offsets, [[table[r, d] for d in offsets] for r in range(size)],
                        [sum(n for _, n in p) for p in pieces])
