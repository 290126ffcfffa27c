"""The cost model: per candidate, the predicted time of one attention
forward + backward (or forward) on the slowest rank, the bytes a rank sends
and its peak memory (DESIGN.md section 13).

Time has three parts: compute (the ring's own plan, cplib/strategy/plan.py,
each call priced by cplib/strategy/kernels.py, the ranks of a node sharing
its cores where they must), the exchange the compute does not hide, and the
fixed cost of every collective (cplib/strategy/ring_cost.py).

Every family's cost function is in one table, :data:`FAMILIES`: "ring",
"ulysses" and "usp" below, "flex" in flex_cost.py."""

from __future__ import annotations

from typing import Callable

from ..attention.names import Layout
from .calibration import Calibration
from .candidates import FLEX, Candidate
from .flex_cost import flex_cost
from .memory import peak_memory
from .prediction import Prediction
from .ring_cost import Part, ring_part, schedule_cost, ulysses_part
from .workload import Workload

__all__ = ["FAMILIES", "predict", "ring_part", "ulysses_part", "schedule_cost", "combine"]


CostFn = Callable[[Candidate, Workload, Calibration], Prediction]


def predict(c: Candidate, w: Workload, cal: Calibration) -> Prediction:
    if c.family not in FAMILIES:
        raise ValueError(f"cplib.strategy: no cost function for family {c.family!r}; "
                         f"known: {sorted(FAMILIES)}")
    return FAMILIES[c.family](c, w, cal)


def _family_ring(c: Candidate, w: Workload, cal: Calibration) -> Prediction:
    return combine(c, w, cal, [ring_part(w, cal, w.world_size, 1, w.q_heads, w.kv_heads,
                                          c.rotate or "p2p", c.layout)])


def _family_ulysses(c: Candidate, w: Workload, cal: Calibration) -> Prediction:
    u = c.ulysses_degree
    # Every rank of the group runs the whole sequence's attention on its heads:
    # the ring's plan on a ring of one (what the op runs for masks too).
    local = ring_part(w, cal, 1, u, w.q_heads // u, w.kv_heads_after(u), "p2p",
                      str(Layout.SEQUENTIAL))
    return combine(c, w, cal, [ulysses_part(w, cal, u), local])


def _family_usp(c: Candidate, w: Workload, cal: Calibration) -> Prediction:
    u = c.ulysses_degree
    ring = ring_part(w, cal, w.world_size // u, u, w.q_heads // u, w.kv_heads_after(u),
                     c.rotate or "p2p", c.layout)
    return combine(c, w, cal, [ulysses_part(w, cal, u), ring])


def combine(c: Candidate, w: Workload, cal: Calibration, parts: list[Part]) -> Prediction:
    compute = sum(p.compute for p in parts)
    exposed = sum(p.exposed for p in parts)
    fixed = sum(p.fixed for p in parts)
    return Prediction(compute + exposed + fixed, compute, exposed, fixed,
                      sum(p.sent for p in parts), peak_memory(c, w))


# Every family the model prices, by name: ``cost(candidate, workload,
# calibration)`` gives a candidate of it its Prediction.
FAMILIES: dict[str, CostFn] = {
    "ring": _family_ring,
    "ulysses": _family_ulysses,
    "usp": _family_usp,
    FLEX: flex_cost,
}
