"""The candidates the model weighs.

A ``Candidate`` names a *family* (whose cost function is in
:data:`cplib.strategy.cost.FAMILIES`) and its settings: the ring's rotation,
the Ulysses degree, the sequence layout, and free-form ``options`` for
families added later. *Sources* list the candidates that apply to a
workload, all in one table (:data:`SOURCES`): the ring with each rotation,
Ulysses when the heads allow it, USP with every Ulysses degree that divides
the group, the heads and the node, the ring on the document placement where
the call has documents, and the flex ring and all-gather for a flex call.

Adding a strategy: its family's cost function in ``FAMILIES``, a source of
its candidates in ``SOURCES`` (see docs/strategy.md, "Adding a candidate")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

from ..attention.names import ROTATIONS, Layout
from .plan import layout_allows_ulysses
from .workload import Workload

__all__ = ["Candidate", "Constraints", "SOURCES", "candidates_for", "heads_allow",
           "data_layout", "FLEX"]

# The flex family's name (a flex call's Workload carries its plan under it too).
FLEX = "flex"


@dataclass(frozen=True)
class Candidate:
    """``family``: "ring", "ulysses", "usp" or a registered one; ``rotate``:
    the ring part's rotation (None: no ring); ``ulysses_degree``: U (1: no
    Ulysses); ``layout``: the ring layout over the N / U ring positions
    (cplib/strategy/plan.py's names); ``options``: (name, value) pairs a
    later family reads (a flex rotation, a placement's parameters)."""

    family: str
    rotate: str | None = None
    ulysses_degree: int = 1
    layout: str = str(Layout.HEAD_TAIL)
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def name(self) -> str:
        if self.family == "ring":
            base = f"ring {self.rotate}"
        elif self.family == "ulysses":
            base = f"ulysses U={self.ulysses_degree}"
        elif self.family == "usp":
            base = f"usp U={self.ulysses_degree} {self.rotate}"
        else:
            base = " ".join([self.family] + [str(x) for x in (self.rotate,) if x]
                            + ([f"U={self.ulysses_degree}"] if self.ulysses_degree > 1 else []))
        extra = "".join(f" {k}={v}" for k, v in self.options)
        return base + extra + ("" if self.layout in (Layout.HEAD_TAIL, Layout.SEQUENTIAL)
                               else f" ({self.layout})")

    def option(self, name: str, default: Any = None) -> Any:
        return dict(self.options).get(name, default)


@dataclass(frozen=True)
class Constraints:
    """What the call fixes. ``rotate`` / ``ulysses_degree``: explicit
    settings (they win); ``families``: the families allowed (``ring_sdpa``:
    the ring only); ``data_layout``: the layout the shards already have
    (:func:`data_layout`), or None where the candidate may choose it
    (sharding still to come); ``memory_limit``: bytes per rank; ``margin``:
    torch's prototype default (the ring with all-gather), where admitted and
    within the limit, is kept unless another candidate is predicted more than
    this fraction faster."""

    rotate: str | None = None
    ulysses_degree: int | None = None
    families: tuple[str, ...] | None = None
    data_layout: tuple | None = None
    memory_limit: int | None = None
    margin: float = 0.0

    def admits(self, c: Candidate, world_size: int) -> bool:
        if self.families is not None and c.family not in self.families:
            return False
        if self.rotate is not None and c.rotate is not None and c.rotate != self.rotate:
            return False
        if self.ulysses_degree is not None and c.ulysses_degree != self.ulysses_degree:
            return False
        if self.data_layout is not None and \
                data_layout(c.layout, world_size // c.ulysses_degree) != self.data_layout:
            return False
        return True


def data_layout(layout: str, ring_degree: int) -> tuple:
    """Where the shards' rows sit for a ring layout over ``ring_degree``
    positions cut in N / ring_degree pieces each (USP's layout): sequential
    for every degree is one layout; the others depend on the degree (over
    one position, every layout is the identity)."""
    if layout == Layout.SEQUENTIAL or ring_degree == 1:
        return (str(Layout.SEQUENTIAL),)
    return (layout, ring_degree)


def heads_allow(q_heads: int, kv_heads: int, degree: int) -> bool:
    """cplib/ulysses/args.py's check_heads, as a predicate."""
    return (degree >= 1 and kv_heads >= 1 and q_heads % kv_heads == 0 and q_heads % degree == 0
            and (kv_heads % degree == 0 or degree % kv_heads == 0))


def _ring_layout(w: Workload) -> str:
    if w.layout is not None:
        return w.layout
    return str(Layout.HEAD_TAIL)  # torch's default (load balancing on)


def _ring(w: Workload) -> Iterable[Candidate]:
    layout = _ring_layout(w)
    for rotate in ROTATIONS:
        yield Candidate("ring", rotate, 1, layout)


def _degrees(w: Workload) -> list[int]:
    """Ulysses degrees > 1 that divide the group, the heads and the node."""
    node = w.ranks_per_node
    return [u for u in range(2, w.world_size + 1)
            if w.world_size % u == 0 and heads_allow(w.q_heads, w.kv_heads, u)
            and u <= node and node % u == 0]


def _ulysses(w: Workload) -> Iterable[Candidate]:
    if w.world_size in _degrees(w) and layout_allows_ulysses(w.layout):
        yield Candidate("ulysses", None, w.world_size, str(Layout.SEQUENTIAL))


def _usp(w: Workload) -> Iterable[Candidate]:
    if not layout_allows_ulysses(w.layout):
        return
    layout = _ring_layout(w)
    for u in _degrees(w):
        if u < w.world_size:
            for rotate in ROTATIONS:
                yield Candidate("usp", rotate, u, layout)


def _placement(w: Workload) -> Iterable[Candidate]:
    """The ring on the document placement (issue 36's
    ``DocumentPlacementLoadBalancer``: short documents whole on one rank, only
    the rows of documents that span ranks exchanged), where the call has
    documents and its layout is still free (or is the placement already)."""
    placement = str(Layout.PLACEMENT)
    if w.documents is None or len(w.documents) <= 2 or w.layout not in (None, placement):
        return
    for rotate in ROTATIONS:
        yield Candidate("ring", rotate, 1, placement)


def _flex(w: Workload) -> Iterable[Candidate]:
    """The flex ring and the flex all-gather, for a flex call's Workload
    (its plan in ``extras``: cplib/strategy/flex_cost.py)."""
    if w.extra(FLEX) is None:
        return
    for rotate in ("p2p", "allgather"):
        yield Candidate(FLEX, rotate, 1, str(Layout.SEQUENTIAL))


Source = Callable[[Workload], Iterable[Candidate]]
# Every source of candidates, in the order candidates are listed (ties go to
# the earlier one); each yields nothing where its family does not apply.
SOURCES: tuple[Source, ...] = (_ring, _ulysses, _usp, _placement, _flex)


def candidates_for(w: Workload, constraints: Constraints = Constraints()) -> list[Candidate]:
    """Every source's candidates for ``w`` that ``constraints`` admit, in the
    order of :data:`SOURCES` (earlier wins ties)."""
    found: list[Candidate] = []
    for source in SOURCES:
        for c in source(w):
            if c not in found and constraints.admits(c, w.world_size):
                found.append(c)
    return found
