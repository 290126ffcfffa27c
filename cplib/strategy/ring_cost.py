"""The time of a ring's schedule and of Ulysses' exchanges (the parts the
families of cost.py combine).

* Compute: per rank and step, the seconds of its calls (kernels.py). The
  ranks of a node compute at once, as fast as ``Calibration.cores`` allow
  (on CPU the ranks share the cores: a step takes at least the node's work
  over its cores; on GPUs each rank has its own device): the
  :func:`parallel_wall` of their loads.
* Steps are lock-stepped for p2p / alltoall (each step's exchange needs
  every rank), so their time is the sum over steps; an all-gather computes
  each rank's steps back to back, after its one gather.
* Exchange: bytes over the measured link rate (inter-node where a message
  crosses nodes); a ring step's exchange is hidden by the step's compute up
  to ``Calibration.overlap``; Ulysses' all-to-alls and the all-gather's are
  exposed. Fixed: the measured cost of every collective."""

from __future__ import annotations

from dataclasses import dataclass

from .calibration import Calibration
from .kernels import call_seconds
from .plan import RingSchedule, StepWork, ring_schedule
from .workload import Workload

__all__ = ["Part", "ring_part", "schedule_cost", "ulysses_part", "parallel_wall",
           "step_seconds"]


@dataclass
class Part:
    compute: float = 0.0
    exposed: float = 0.0
    fixed: float = 0.0
    sent: float = 0.0


def parallel_wall(loads: list[float], w: Workload, cal: Calibration, stride: int = 1) -> float:
    """Wall seconds of ring positions computing ``loads`` at once, position p
    on ranks p * stride .. p * stride + stride - 1 (USP: its ring groups run
    alike): the largest load, or a node's total over its cores if more."""
    worst = max(loads, default=0.0)
    if cal.cores <= 0:
        return worst
    node = max(w.ranks_per_node, 1)
    totals: dict[int, float] = {}
    for p, load in enumerate(loads):
        key = p * stride // node
        totals[key] = totals.get(key, 0.0) + load * min(stride, node)
    return max(worst, max(totals.values()) / cal.cores)


def _node_bps(w: Workload, cal: Calibration, a: int, b: int) -> float:
    node = w.ranks_per_node
    return cal.link_bps if a // node == b // node else cal.inter_node_bps


def step_seconds(work: StepWork | None, w: Workload, cal: Calibration, heads: int,
                 kv_heads: int) -> float:
    """One rank's seconds at one step: its calls (0 where it skips the step)."""
    if work is None:
        return 0.0
    return sum(call_seconds(kind, ql, kl, w, cal, heads, kv_heads)
               for kind, ql, kl in work.shapes)


def ring_part(w: Workload, cal: Calibration, size: int, stride: int, heads: int,
              kv_heads: int, rotate: str, layout: str) -> Part:
    """The ring over ``size`` positions ``stride`` ranks apart (USP's ring
    groups), ``heads`` q heads and ``kv_heads`` K/V heads per rank."""
    left, right = w.sides
    sched = ring_schedule(w.seq_len, size, layout, w.is_causal, left, right, w.documents,
                          rotate)
    return schedule_cost(w, cal, sched, stride, heads, kv_heads, rotate)


def _allgather(w: Workload, cal: Calibration, sched: RingSchedule, stride: int,
               per_rank: list[list[float]], row: float) -> Part:
    """One gather up front (again in the backward) of every block padded to
    the longest, each rank's steps back to back, one reduce-scatter."""
    size, a, e = sched.size, w.acc_size, w.element_size
    part = Part(compute=parallel_wall([sum(steps) for steps in per_rank], w, cal, stride))
    if size == 1:
        return part
    longest = row * max(sched.rows)
    bps = min(_node_bps(w, cal, 0, r * stride) for r in range(size))
    gathers = 2 if w.backward else 1
    part.exposed = gathers * (size - 1) * longest / bps
    if w.device_type == "cpu":  # gloo: the input repeated N times (comm/native.py)
        part.exposed += parallel_wall([gathers * size * longest * 2 / cal.copy_bps] * size,
                                      w, cal, stride)
    part.fixed = gathers * cal.latency_s
    part.sent = gathers * (size - 1) * longest
    if w.backward:  # the reduce-scatter: as slow as the slowest link it crosses
        rs_bps = cal.reduce_scatter_bps if bps == cal.link_bps else \
            min(cal.reduce_scatter_bps, bps)
        part.exposed += size * longest * a / e / rs_bps
        part.fixed += cal.reduce_scatter_s
        part.sent += (size - 1) * longest * a / e
    return part


def schedule_cost(w: Workload, cal: Calibration, sched: RingSchedule, stride: int, heads: int,
                  kv_heads: int, rotate: str) -> Part:
    """What a ring of ``sched`` costs: its steps' compute, its exchanges (the
    rows each receiver reads, per step, with "p2p" / "alltoall"; one gather
    and one reduce-scatter with "allgather"), its collectives. A family with
    its own schedule (a flex ring's BlockMask) builds a RingSchedule and
    calls this."""
    size = sched.size
    d, e, a = w.head_dim + w.v_head_dim, w.element_size, w.acc_size
    row = w.batch * kv_heads * d * e  # bytes of one K|V row (all heads)
    per_rank = [[step_seconds(work, w, cal, heads, kv_heads) for work in sched.work[r]]
                for r in range(size)]
    if rotate == "allgather":
        return _allgather(w, cal, sched, stride, per_rank, row)
    part = Part()
    colls = 3 if w.backward else 1  # K|V fwd, K|V again and dK|dV back in the bwd
    sent = [0.0] * size
    for s, off in enumerate(sched.offsets):
        step = parallel_wall([per_rank[r][s] for r in range(size)], w, cal, stride)
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


def ulysses_part(w: Workload, cal: Calibration, degree: int) -> Part:
    """The all-to-alls of a Ulysses group of ``degree`` consecutive ranks
    (sequence -> heads for q, k, v and back for out; the reverse in the
    backward), exposed, each packed with one strided copy (every rank at
    once: over the node's cores)."""
    part = Part()
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
    ranks = [0.0] * min(w.world_size, node)
    for t in tensors:
        on = t * (share - off_node) / cal.link_bps
        across = t * off_node / cal.inter_node_bps
        pack = parallel_wall([2 * t / cal.copy_bps for _ in ranks], w, cal)
        part.exposed += max(on, across) + pack
        part.fixed += cal.latency_s
        part.sent += t * share
    return part
