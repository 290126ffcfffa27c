"""The flex family's cost: the flex ring ("flex p2p": each rank visits only
the K/V blocks its sharded BlockMask needs, cplib/flex/ring.py) and the flex
all-gather ("flex allgather": K/V of the whole sequence gathered, one
flex_attention call), priced from the flex ring's own plan (the candidates
themselves: candidates.py).

A flex call's Workload carries a :class:`FlexStats` in its extras (made by
cplib/flex/strategy_route.py from every rank's plan): per (receiving rank,
owning rank), the K/V rows the ring moves and the query-key cells of the
mask's partial and full blocks. From it:

* bytes received per rank are exact, the rows the plan moves times the
  bytes of a K|V row (what ``cplib_c::flex_ring_debug_bytes`` counts): the
  visited rows in the forward, again in the backward, plus the dK|dV of our
  rows the visitors send back; the all-gather's (N - 1) shards, and their
  gradients in its reduce-scatter;
* compute: one call per visited rank for the ring (lock-stepped over the
  plan's offsets), one call over every key for the all-gather. A call is
  priced by its cells: eagerly (``FlexStats.eager``) flex_attention
  materialises the scores of its whole area (queries x keys of the call),
  mask_mod evaluated on each, at the calibrated masked rate; compiled, only
  the mask's blocks: partial ones at the masked rate, full ones at the
  unmasked rate. Plus the fixed cost per call and the memory passes around
  it (kernels.pass_seconds);
* exchange and fixed costs as the SDPA ring's (ring_cost.py): a ring step's
  exchange at the link rate, hidden up to ``overlap``; the all-gather's
  exposed, with gloo's repeated input on CPU;
* peak memory: the ring holds its own shard's accumulators plus one
  visiting block (and its gradient); the all-gather the gathered K/V of the
  whole sequence (saved for the backward) and its gradient. Eagerly, the
  materialised scores of the largest call (2 x fp32 per cell: scores and
  probabilities).
"""

from __future__ import annotations

from dataclasses import dataclass

from .calibration import Calibration
from .candidates import FLEX, Candidate
from .kernels import pass_seconds
from .prediction import Prediction
from .ring_cost import _node_bps, parallel_wall
from .workload import Workload

__all__ = ["FlexStats", "flex_cost", "received_per_rank", "sent_per_rank"]


@dataclass(frozen=True)
class FlexStats:
    """The flex plan of one sharded BlockMask, over all ranks: ``recv[r][j]``
    K/V rows rank r receives from rank j (0 for j == r); ``partial[r][j]`` /
    ``full[r][j]`` the cells (query rows x key rows, summed over batch and
    query heads) of rank r's partial / full mask blocks on rank j's keys;
    ``q_rows[r][j]`` the query rows of rank r's ring call on rank j's keys
    (the span that sees them; 0 when not visited); ``q_len`` each rank's
    rows; ``eager``: calls run eagerly (flex computes each call's whole
    area)."""

    q_len: int
    recv: tuple[tuple[int, ...], ...]
    partial: tuple[tuple[int, ...], ...]
    full: tuple[tuple[int, ...], ...]
    q_rows: tuple[tuple[int, ...], ...]
    eager: bool = True

    @property
    def world(self) -> int:
        return len(self.recv)

    def needs(self, r: int, j: int) -> bool:
        """Whether rank r's queries see any key of rank j."""
        return self.partial[r][j] + self.full[r][j] > 0

    def offsets(self) -> list[int]:
        """The ring's steps (as cplib/flex/plan.py visits them): 0, then
        every offset some rank receives rows at."""
        n = self.world
        return [0] + [d for d in range(1, n) if any(self.recv[r][(r - d) % n] for r in range(n))]


def _stats(w: Workload) -> FlexStats | None:
    return w.extra(FLEX)


def _row_bytes(w: Workload) -> int:
    """Bytes of one sequence row of K and V together (all heads, the batch)."""
    return w.batch * w.kv_heads * (w.head_dim + w.v_head_dim) * w.element_size


def received_per_rank(w: Workload, rotate: str) -> list[float]:
    """Bytes each rank receives in one call (fwd, or fwd+bwd): for the ring,
    exactly what its exchange counter reports."""
    s, row = _stats(w), _row_bytes(w)
    n = s.world
    if rotate == "allgather":
        return [float((n - 1) * s.q_len * row * (2 if w.backward else 1))] * n
    out = []
    for r in range(n):
        visited = sum(s.recv[r])
        back = sum(s.recv[j][r] for j in range(n)) if w.backward else 0
        out.append(float(row * (visited * (2 if w.backward else 1) + back)))
    return out


def sent_per_rank(w: Workload, rotate: str) -> list[float]:
    """Bytes each rank sends in one call (the mirror of what others receive)."""
    s, row = _stats(w), _row_bytes(w)
    n = s.world
    if rotate == "allgather":
        return received_per_rank(w, rotate)
    out = []
    for r in range(n):
        mine = sum(s.recv[j][r] for j in range(n))
        back = sum(s.recv[r]) if w.backward else 0
        out.append(float(row * (mine * (2 if w.backward else 1) + back)))
    return out


def _call_seconds(w: Workload, cal: Calibration, partial: float, full: float,
                  q_rows: int, k_rows: int, merge: bool) -> float:
    """One flex call of ``q_rows`` of this rank's queries against ``k_rows``
    keys whose mask blocks cover ``partial`` / ``full`` cells (see the
    module docstring)."""
    d = w.head_dim + w.v_head_dim
    scale = 1.0 if w.backward else cal.fwd_fraction
    if _stats(w).eager:
        kernel = cal.masked_unit_s * w.batch * w.q_heads * q_rows * k_rows * d
    else:
        kernel = cal.masked_unit_s * partial * d + cal.unit_s * full * d
    passes = pass_seconds(q_rows, k_rows, w, cal, w.q_heads, w.kv_heads) if merge else 0.0
    return scale * (kernel + cal.call_s) + passes


def _ring_time(w: Workload, cal: Calibration) -> tuple[float, float, float]:
    s, row, n = _stats(w), _row_bytes(w), _stats(w).world
    compute = exposed = fixed = 0.0
    colls = 3 if w.backward else 1  # K|V fwd, K|V again and dK|dV back in the bwd
    for d in s.offsets():
        loads = []
        for r in range(n):
            src = (r - d) % n
            rows = s.q_len if d == 0 else s.recv[r][src]
            sees = s.needs(r, src) if d == 0 else rows > 0
            loads.append(_call_seconds(w, cal, s.partial[r][src], s.full[r][src],
                                       s.q_rows[r][src], rows, True)
                         if sees else 0.0)
        step = parallel_wall(loads, w, cal)
        compute += step
        if d == 0:
            continue
        comm = 0.0
        for r in range(n):
            src, dst = (r - d) % n, (r + d) % n
            moved = row * (s.recv[r][src] * (2 if w.backward else 1)
                           + (s.recv[dst][r] if w.backward else 0))
            if moved:
                comm = max(comm, moved / _node_bps(w, cal, r, src))
        exposed += max(0.0, comm - cal.overlap * step)
        fixed += colls * cal.latency_s
    return compute, exposed, fixed


def _allgather_time(w: Workload, cal: Calibration) -> tuple[float, float, float]:
    s, row, n = _stats(w), _row_bytes(w), _stats(w).world
    loads = [_call_seconds(w, cal, sum(s.partial[r]), sum(s.full[r]), s.q_len, n * s.q_len,
                           False)
             for r in range(n)]
    compute = parallel_wall(loads, w, cal)
    if n == 1:
        return compute, 0.0, 0.0
    shard = s.q_len * row
    bps = min(_node_bps(w, cal, 0, r) for r in range(n))
    exposed = (n - 1) * shard / bps
    if w.device_type == "cpu":  # gloo: the input repeated N times (comm/native.py)
        exposed += parallel_wall([n * shard * 2 / cal.copy_bps] * n, w, cal)
    fixed = cal.latency_s
    if w.backward:  # the gathered gradients reduce-scattered back
        exposed += n * shard / min(cal.reduce_scatter_bps, bps)
        fixed += cal.reduce_scatter_s
    return compute, exposed, fixed


def _peak(w: Workload, rotate: str) -> float:
    s = _stats(w)
    b, e, a, n = w.batch, w.element_size, w.acc_size, s.world
    q = b * w.q_heads * s.q_len * w.head_dim * e
    out = b * w.q_heads * s.q_len * w.v_head_dim * e
    kv = s.q_len * _row_bytes(w)  # this rank's K|V shard
    if rotate == "allgather":
        keys = n * s.q_len
        gathered = n * kv + (n * kv if w.device_type == "cpu" else 0)
        blocks = gathered + (n * kv + kv if w.backward else 0)  # dK|dV gathered, scattered
    else:
        keys = max([s.q_len] + [x for r in s.recv for x in r])
        visiting = keys * _row_bytes(w)
        # one block in use, one in flight; in the bwd its gradient and ours (fp32)
        blocks = 2 * visiting + ((visiting + kv) * a / e if w.backward else 0)
    total = out * a / e + blocks + (out + q * a / e + q if w.backward else 0)
    if s.eager:  # the scores and probabilities of the largest call
        total += 2 * b * w.q_heads * s.q_len * keys * 4
    return float(total)


def flex_cost(c: Candidate, w: Workload, cal: Calibration) -> Prediction:
    """The flex family's cost function (cost.FAMILIES)."""
    rotate = c.rotate or "p2p"
    parts = _allgather_time(w, cal) if rotate == "allgather" else _ring_time(w, cal)
    compute, exposed, fixed = parts
    return Prediction(compute + exposed + fixed, compute, exposed, fixed,
                      max(sent_per_rank(w, rotate)), _peak(w, rotate),
                      tuple(received_per_rank(w, rotate)))

