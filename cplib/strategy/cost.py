"""The cost model: per candidate, the predicted time of one attention
forward + backward (or forward) on the slowest rank, the bytes a rank sends
and its peak memory.

Time has four parts (DESIGN.md section 13):

* compute: the ring's counted schedule (cplib/strategy/plan.py): pairs of
  unmasked calls and areas of masked tiles, times the measured per-unit
  kernel time, plus a fixed cost per kernel call, plus the memory passes
  around them (merges, gradient accumulation, GQA expansion, masks) at the
  measured copy rate;
* exchange: bytes over the measured link rate (inter-node where a message
  crosses nodes); a ring step's exchange is hidden by the step's compute up
  to ``Calibration.overlap``, Ulysses' all-to-alls and the all-gather are not;
* fixed: the measured cost of every collective;
* steps are lock-stepped for p2p / alltoall (each step's exchange needs
  every rank), so their compute is the sum over steps of the slowest rank's;
  an all-gather computes each rank's steps back to back.

Families register here (:func:`register_family`); "ring", "ulysses" and
"usp" are below."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .calibration import Calibration
from .candidates import Candidate
from .memory import peak_memory
from .plan import RingSchedule, StepWork, ring_schedule
from .workload import Workload

__all__ = ["Prediction", "register_family", "predict", "families", "ring_part",
           "ulysses_part", "schedule_cost", "combine"]


@dataclass(frozen=True)
class Prediction:
    """Seconds on the slowest rank (``time_s`` = ``compute_s`` +
    ``exposed_s`` + ``fixed_s``), bytes sent per rank (the most any rank
    sends), and peak bytes per rank beyond the inputs."""

    time_s: float
    compute_s: float
    exposed_s: float
    fixed_s: float
    bytes_sent: float
    memory_bytes: float


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


# ------------------------------------------------------------------ shared parts


def _node_bps(w: Workload, cal: Calibration, a: int, b: int) -> float:
    node = w.ranks_per_node
    return cal.link_bps if a // node == b // node else cal.inter_node_bps


def _step_compute(work: StepWork, w: Workload, cal: Calibration, heads: int, kv_heads: int,
                  q_rows: int, k_rows: int) -> float:
    """Seconds of one rank's calls at one step (fwd+bwd, or fwd only)."""
    d = w.head_dim + w.v_head_dim
    scale = 1.0 if w.backward else cal.fwd_fraction
    kernels = (work.pairs * cal.unit_s + work.masked * cal.masked_unit_s) * d * w.batch * heads
    kernels += work.masked * cal.mask_s  # once per call, whatever the heads
    calls = (work.calls + work.masked_calls) * cal.call_s
    # Memory passes: the merge into the fp32 accumulators (fwd) and dQ /
    # dK|dV accumulation (bwd), and K/V expanded to q's heads for GQA. (The
    # masks' construction is in masked_unit_s: the calibration builds them.)
    a, e = w.acc_size, w.element_size
    passes = w.batch * heads * q_rows * w.v_head_dim * (2 * a + e)
    if w.backward:
        passes += w.batch * heads * q_rows * w.head_dim * (2 * a + e)
        passes += w.batch * kv_heads * k_rows * d * 3 * a
    if heads != kv_heads:
        passes += w.batch * heads * k_rows * d * e * (2 if w.backward else 1)
    return scale * (kernels + calls) + passes / cal.copy_bps


@dataclass
class _Part:
    compute: float = 0.0
    exposed: float = 0.0
    fixed: float = 0.0
    sent: float = 0.0


def _schedule(w: Workload, size: int, layout: str, rotate: str) -> RingSchedule:
    left, right = w.sides
    return ring_schedule(w.seq_len, size, layout, w.is_causal, left, right, w.documents, rotate)


def ring_part(w: Workload, cal: Calibration, size: int, stride: int, heads: int,
              kv_heads: int, rotate: str, layout: str) -> _Part:
    """The ring over ``size`` positions ``stride`` ranks apart (USP's ring
    groups), ``heads`` q heads and ``kv_heads`` K/V heads per rank."""
    return schedule_cost(w, cal, _schedule(w, size, layout, rotate), stride, heads, kv_heads,
                         rotate)


def schedule_cost(w: Workload, cal: Calibration, sched: RingSchedule, stride: int, heads: int,
                  kv_heads: int, rotate: str) -> _Part:
    """What a ring of ``sched`` costs: its steps' compute, its exchanges
    (one block per step with "p2p" / "alltoall", or one gather and one
    reduce-scatter with "allgather"), its collectives. A family with its own
    schedule (a flex ring's BlockMask) builds a RingSchedule and calls this."""
    size = sched.size
    d, e, a = w.head_dim + w.v_head_dim, w.element_size, w.acc_size
    row = w.batch * kv_heads * d * e  # bytes of one K|V row (all heads)
    block = [row * rows for rows in sched.rows]
    part = _Part()
    colls = 3 if w.backward else 1  # K|V fwd, K|V again and dK|dV back in the bwd
    per_rank = [[_step_compute(work, w, cal, heads, kv_heads, sched.rows[r],
                               sched.rows[(r - off) % size]) if work is not None else 0.0
                 for work, off in zip(sched.work[r], sched.offsets)] for r in range(size)]
    if rotate == "allgather":
        part.compute = max(sum(steps) for steps in per_rank)
        if size > 1:
            longest = max(block)
            bps = min(_node_bps(w, cal, 0, r * stride) for r in range(size))
            gathers = 2 if w.backward else 1
            part.exposed = gathers * (size - 1) * longest / bps
            if w.device_type == "cpu":  # gloo: the input repeated N times (comm/native.py)
                part.exposed += gathers * size * longest * 2 / cal.copy_bps
            part.fixed = gathers * cal.latency_s
            part.sent = gathers * (size - 1) * longest
            if w.backward:  # the reduce-scatter: as slow as the slowest link it crosses
                rs_bps = cal.reduce_scatter_bps if bps == cal.link_bps else \
                    min(cal.reduce_scatter_bps, bps)
                part.exposed += size * longest * a / e / rs_bps
                part.fixed += cal.reduce_scatter_s
                part.sent += (size - 1) * longest * a / e
        return part
    sent = [0.0] * size
    for s, off in enumerate(sched.offsets):
        step = max(per_rank[r][s] for r in range(size))
        part.compute += step
        if off == 0:
            continue
        # Rank r sends the rows of its block that r + off reads (again in the
        # backward), and that rank sends their gradient back (fp32).
        comm = 0.0
        for r in range(size):
            dst = (r + off) % size
            rows = sched.sent_rows(r, s)
            if rows:
                kv = row * rows * (2 if w.backward else 1)
                back = row * rows * a / e if w.backward else 0.0
                sent[r] += kv
                sent[dst] += back
                comm = max(comm, (kv + back) / _node_bps(w, cal, r * stride, dst * stride))
        part.exposed += max(0.0, comm - cal.overlap * step)
        part.fixed += colls * cal.latency_s
    part.sent = max(sent)
    return part


def ulysses_part(w: Workload, cal: Calibration, degree: int) -> _Part:
    """The all-to-alls of a Ulysses group of ``degree`` consecutive ranks
    (sequence -> heads for q, k, v and back for out; the reverse in the
    backward), exposed, each packed with one strided copy."""
    part = _Part()
    if degree == 1:
        return part
    rows = w.seq_len / w.world_size
    e, b = w.element_size, w.batch
    kv = b * w.kv_heads_after(degree) * degree * rows * e
    q, out = b * w.q_heads * rows * w.head_dim * e, b * w.q_heads * rows * w.v_head_dim * e
    tensors = [q, kv * w.head_dim, kv * w.v_head_dim, out]
    if w.backward:
        tensors += [out, q, kv * w.head_dim, kv * w.v_head_dim]
    node = w.ranks_per_node
    off_node = max(0, degree - node) / degree if degree > node else 0.0
    share = (degree - 1) / degree
    for t in tensors:
        on = t * (share - off_node) / cal.link_bps
        across = t * off_node / cal.inter_node_bps
        part.exposed += max(on, across) + 2 * t / cal.copy_bps
        part.fixed += cal.latency_s
        part.sent += t * share
    return part


def _family_ring(c: Candidate, w: Workload, cal: Calibration) -> Prediction:
    return combine(c, w, cal, [ring_part(w, cal, w.world_size, 1, w.q_heads, w.kv_heads,
                                          c.rotate or "p2p", c.layout)])


def _family_ulysses(c: Candidate, w: Workload, cal: Calibration) -> Prediction:
    u = c.ulysses_degree
    local = ring_part(w, cal, 1, 1, w.q_heads // u, w.kv_heads_after(u), "p2p", "sequential")
    return combine(c, w, cal, [ulysses_part(w, cal, u), local])


def _family_usp(c: Candidate, w: Workload, cal: Calibration) -> Prediction:
    u = c.ulysses_degree
    ring = ring_part(w, cal, w.world_size // u, u, w.q_heads // u, w.kv_heads_after(u),
                     c.rotate or "p2p", c.layout)
    return combine(c, w, cal, [ulysses_part(w, cal, u), ring])


def combine(c: Candidate, w: Workload, cal: Calibration, parts: list[_Part]) -> Prediction:
    compute = sum(p.compute for p in parts)
    exposed = sum(p.exposed for p in parts)
    fixed = sum(p.fixed for p in parts)
    return Prediction(compute + exposed + fixed, compute, exposed, fixed,
                      sum(p.sent for p in parts), peak_memory(c, w))


register_family("ring", _family_ring)
register_family("ulysses", _family_ulysses)
register_family("usp", _family_usp)
