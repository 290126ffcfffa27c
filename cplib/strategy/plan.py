"""The ring's schedule, as the ring's own planner makes it: for every rank and
ring step, the kernel calls the ring makes (full rectangles, causal
diagonals, masked tiles, with their rows x keys) and the rows of the visited
block that travel. It comes from ``cplib_c::ring_plan_summary``
(csrc/torch/ring/ring_plan_summary.cpp), which builds the ring's RingPlan
from the same layout and mask the op builds: one planner, so the model counts
exactly what the op computes and sends (windows, documents, the document
placement, blocks nobody needs, rows nobody reads).

Layouts are named: "head_tail", "sequential" and "per_document" are the
ring's own (cplib.attention.names.LAYOUTS); :func:`register_layout` adds one the
ring runs (the document placement: cplib/strategy/placement.py)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from ..attention.names import LAYOUTS, Layout

__all__ = ["register_layout", "layout_load_balance", "ring_layout", "layout_allows_ulysses",
           "StepWork", "RingSchedule", "ring_schedule", "FULL", "CAUSAL", "PARTIAL"]

# Call kinds (the ring's Visibility codes, csrc/torch/ring/ring_mask.h).
FULL, CAUSAL, PARTIAL = 1, 2, 3

_layouts: dict[str, str] = {}
_load_balance: dict[str, object] = {}
_ring_only: set[str] = set()


def register_layout(name: str, ring: str, load_balance: object = None,
                    ulysses: bool = True) -> None:
    """Adds a sequence layout the model can cost: ``ring`` is the ring's
    layout that runs it (one of cplib.attention.names.LAYOUTS, as ``ring_sdpa``
    runs it). A candidate naming it in ``Candidate.layout`` is costed on the
    ring's plan for it. ``load_balance``: the value of
    ``context_parallel(load_balance=...)`` that shards the buffers in this
    layout, for a choice made on entry; ``ulysses``: whether USP runs in it
    (False: a ring-only layout, so neither Ulysses nor USP is a candidate
    where the data is in it)."""
    if ring not in LAYOUTS:
        raise ValueError(f"cplib.strategy: register_layout({name!r}): {ring!r} is not one of "
                         f"the ring's layouts {list(LAYOUTS)}")
    _layouts[name] = ring
    if load_balance is not None:
        _load_balance[name] = load_balance
    if not ulysses:
        _ring_only.add(name)


def layout_allows_ulysses(name: str | None) -> bool:
    """Whether Ulysses / USP may run where the data is in layout ``name``
    (None: not fixed yet)."""
    return name not in _ring_only


def layout_load_balance(name: str) -> object:
    """``context_parallel``'s ``load_balance`` for a registered layout (None:
    keep the caller's: the built-in layouts follow it)."""
    return _load_balance.get(name)


def ring_layout(name: str) -> str:
    """The ring's layout that runs the registered layout ``name``."""
    if name not in _layouts:
        raise ValueError(f"cplib.strategy: unknown layout {name!r}; known: {sorted(_layouts)}")
    return _layouts[name]


# The ring's layouts by their own names; the document placement registers
# itself with its load balance and as a ring-only layout (placement.py).
for _layout in Layout:
    if _layout is not Layout.PLACEMENT:
        register_layout(str(_layout), str(_layout))


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
    if docs is None and ring in ("per_document", "placement"):
        docs = [0, seq_len]  # one document: what the ring does without cu_seqlens
    window = None
    if left < seq_len or right < seq_len:
        window = [min(left, seq_len), min(right, seq_len)]
    return _parse(ops.ring_plan_summary(seq_len, size, causal, ring, docs, window, rotate))
