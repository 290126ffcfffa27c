"""The cost model: per candidate, the predicted time of one attention
forward + backward (or forward) on the slowest rank, the bytes a rank sends
and its peak memory (DESIGN.md section 13).

Time has three parts: compute (the ring's own plan, cplib/strategy/plan.py,
each call priced by cplib/strategy/kernels.py, the ranks of a node sharing
its cores where they must), the exchange the compute does not hide, and the
fixed cost of every collective (cplib/strategy/ring_cost.py).

Families register here (:func:`register_family`); "ring", "ulysses" and
"usp" are below."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .calibration import Calibration
from .candidates import Candidate
from .memory import peak_memory
from .ring_cost import Part, ring_part, schedule_cost, ulysses_part
from .workload import Workload

__all__ = ["Prediction", "register_family", "predict", "families", "ring_part",
           "ulysses_part", "schedule_cost", "combine"]


@dataclass(frozen=True)
class Prediction:
    """Seconds on the slowest rank (``time_s`` = ``compute_s`` +
    ``exposed_s`` + ``fixed_s``), bytes sent per rank (the most any rank
    sends), and peak bytes per rank beyond the inputs; ``received``: the
    bytes each rank receives, where a family counts them per rank (flex)."""

    time_s: float
    compute_s: float
    exposed_s: float
    fixed_s: float
    bytes_sent: float
    memory_bytes: float
    received: tuple[float, ...] = ()


CostFn = Callable[[Candidate, Workload, Calibration], Prediction]
_families: dict[str, CostFn] = {}


def register_family(name: str, cost: CostFn) -> None:
    """Makes candidates of family ``name`` costable: ``cost(candidate,
    workload, calibration)`` returns their :class:`Prediction`."""
    _families[name] = cost


def families() -> list[str]:
    return list(_families)


def predict(c: Candidate, w: Workload, cal: Calibration) -> Prediction:
    if c.family not in _families:
        raise ValueError(f"cplib.strategy: no cost function for family {c.family!r}; "
                         f"registered: {sorted(_families)}")
    return _families[c.family](c, w, cal)


def _family_ring(c: Candidate, w: Workload, cal: Calibration) -> Prediction:
    return combine(c, w, cal, [ring_part(w, cal, w.world_size, 1, w.q_heads, w.kv_heads,
                                          c.rotate or "p2p", c.layout)])


def _family_ulysses(c: Candidate, w: Workload, cal: Calibration) -> Prediction:
    u = c.ulysses_degree
    # Every rank of the group runs the whole sequence's attention on its heads:
    # the ring's plan on a ring of one (what the op runs for masks too).
    local = ring_part(w, cal, 1, u, w.q_heads // u, w.kv_heads_after(u), "p2p", "sequential")
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


register_family("ring", _family_ring)
register_family("ulysses", _family_ulysses)
register_family("usp", _family_usp)
