"""The ring's schedule, as the ring's own planner makes it: for every rank and
ring step, the kernel calls the ring makes (full rectangles, causal
diagonals, masked tiles, with their rows x keys) and the rows of the visited
block that travel. It comes from ``cplib_c::ring_plan_summary``
(csrc/torch/ring/ring_plan_summary.cpp), which builds the ring's RingPlan
from the same layout and mask the op builds: one planner, so the model counts
exactly what the op computes and sends (windows, documents, the document
placement, blocks nobody needs, rows nobody reads).

Layouts are the ring's own (cplib.attention.names.Layout), each costed on
the ring's plan for it; :data:`COSTED_LAYOUTS` lists them with what the model
needs to know besides (the document placement's sharding, and that it is a
ring layout only)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from ..attention.names import Layout

__all__ = ["COSTED_LAYOUTS", "layout_load_balance", "ring_layout", "layout_allows_ulysses",
           "StepWork", "RingSchedule", "ring_schedule", "FULL", "CAUSAL", "PARTIAL"]

# Call kinds (the ring's Visibility codes, csrc/torch/ring/ring_mask.h).
FULL, CAUSAL, PARTIAL = 1, 2, 3

# Every layout the model costs, by the ring's name: (the
# ``context_parallel(load_balance=...)`` value that shards the buffers in it
# for a choice made on entry, None: the caller's own; whether Ulysses / USP
# run where the data is in it). The document placement is a ring layout only
# (cplib/ring/placement.py), sharded by load_balance="placement".
COSTED_LAYOUTS: dict[Layout, tuple[object, bool]] = {
    Layout.SEQUENTIAL: (None, True),
    Layout.HEAD_TAIL: (None, True),
    Layout.PER_DOCUMENT: (None, True),
    Layout.PLACEMENT: (str(Layout.PLACEMENT), False),
}


def layout_allows_ulysses(name: str | None) -> bool:
    """Whether Ulysses / USP may run where the data is in layout ``name``
    (None: not fixed yet)."""
    return name is None or name not in COSTED_LAYOUTS or COSTED_LAYOUTS[name][1]


def layout_load_balance(name: str) -> object:
    """``context_parallel``'s ``load_balance`` for a layout chosen on entry
    (None: keep the caller's: the built-in layouts follow it)."""
    return COSTED_LAYOUTS[name][0] if name in COSTED_LAYOUTS else None


def ring_layout(name: str) -> str:
    """The ring's layout that runs the layout ``name`` (its own)."""
    if name not in COSTED_LAYOUTS:
        raise ValueError(f"cplib.strategy: unknown layout {name!r}; known: "
                         f"{sorted(str(x) for x in COSTED_LAYOUTS)}")
    return str(Layout(name))


@dataclass
class StepWork:
    """One rank's calls at one ring step: ``pairs`` the query-key pairs of
    its unmasked calls (full rectangles, causal diagonals), ``masked`` the
    cells of its tiles with an explicit mask, the number of each kind of
    call, ``shapes`` every call's (kind, q rows, k rows), and ``recv_rows``
    the rows of the visited block that reach this rank (0 at step 0)."""

    pairs: float = 0.0
    masked: float = 0.0
    calls: int = 0
    masked_calls: int = 0
    recv_rows: int = 0
    shapes: list = field(default_factory=list)

    def add(self, kind: int, ql: int, kl: int) -> None:
        self.shapes.append((kind, ql, kl))
        if kind == FULL:
            self.pairs += ql * kl
            self.calls += 1
        elif kind == CAUSAL:
            self.pairs += ql * (ql + 1) / 2
            self.calls += 1
        elif kind == PARTIAL:
            self.masked += ql * kl
            self.masked_calls += 1


@dataclass
class RingSchedule:
    """The ring over ``size`` ranks: ``offsets`` visited (0 first, the same
    on every rank), ``work[r][s]`` what rank r computes at step s (None: it
    neither receives nor computes that block), and ``rows[r]`` rank r's
    local rows."""

    size: int
    offsets: list[int]
    work: list[list[StepWork | None]]
    rows: list[int]

    def receives(self, rank: int, step: int) -> bool:
        return self.work[rank][step] is not None

    def sent_rows(self, rank: int, step: int) -> int:
        """Rows of its own block ``rank`` sends at ``step`` (0: none)."""
        if step == 0:
            return 0
        dst = (rank + self.offsets[step]) % self.size
        work = self.work[dst][step]
        return 0 if work is None else work.recv_rows


def _parse(flat: list[int]) -> RingSchedule:
    """The op's flat summary (see ring_plan_summary.cpp) as a RingSchedule."""
    n = flat[0]
    rows, at = flat[1:1 + n], 1 + n
    offsets: list[int] = []
    work: list[list[StepWork | None]] = []
    for r in range(n):
        steps, at = flat[at], at + 1
        mine: list[StepWork | None] = []
        for s in range(steps):
            offset, receives, _sends, recv_len, _send_len, calls = flat[at:at + 6]
            at += 6
            if r == 0:
                offsets.append(offset)
            step = StepWork(recv_rows=recv_len if s > 0 else 0)
            for _ in range(calls):
                step.add(*flat[at:at + 3])
                at += 3
            mine.append(step if receives or s == 0 else None)
        work.append(mine)
    return RingSchedule(n, offsets, work, list(rows))


@functools.lru_cache(maxsize=256)
def ring_schedule(seq_len: int, size: int, layout: str, causal: bool, left: int, right: int,
                  documents: tuple[int, ...] | None, rotate: str = "p2p") -> RingSchedule:
    """The ring's plan over ``size`` ranks on ``layout`` for a mask of
    ``causal``, a window of (``left``, ``right``) (clamped to the length) and
    ``documents`` (cu_seqlens), with ``rotate`` ("allgather" moves whole
    blocks; "p2p" and "alltoall" only the rows a receiver reads)."""
    from ..comm.native import ops

    ring = ring_layout(layout)
    docs = list(documents) if documents is not None and len(documents) > 2 else None
    if docs is None and ring in (Layout.PER_DOCUMENT, Layout.PLACEMENT):
        docs = [0, seq_len]  # one document: what the ring does without cu_seqlens
    window = None
    if left < seq_len or right < seq_len:
        window = [min(left, seq_len), min(right, seq_len)]
    return _parse(ops.ring_plan_summary(seq_len, size, causal, ring, docs, window, rotate))
