"""Peak memory per rank beyond the inputs, per candidate family, in units of
this rank's tensors. The counts follow the ops' buffers and the CPU
allocator's measurements:

* ring p2p / alltoall (tests/ring/test_ring_memory.py: 14.2 K-blocks at N=4,
  fp32 MHA): out, grad_out and dQ, the block kernel's three gradients, two
  K|V blocks (one in use, one in flight), our own dK|dV accumulator and one
  dK|dV in flight; the accumulators in fp32;
* ring allgather (33 K-blocks there at N=4): every rank's K|V gathered,
  its packed copy, every block's gradient (fp32) and the reduce-scatter's
  output, besides out, grad_out, dQ and the kernel's gradients;
* Ulysses (RESULTS.md "Ring vs Ulysses vs USP": 21 MiB, about 10.5 shards
  at N=4): q, k, v and out in the head layout (saved for the backward),
  the output, grad_out and the gradients in the head layout, and one
  packed send buffer;
* USP: the ring's count on the head-layout blocks plus Ulysses' exchange
  buffers (19 shards measured at 2 x 2).

Forward only: the forward's buffers alone (out and its accumulator, the
blocks in flight or gathered)."""

from __future__ import annotations

from .candidates import Candidate
from .workload import Workload

__all__ = ["peak_memory"]


def _ring(w: Workload, rows: float, heads: int, kv_heads: int, size: int, rotate: str) -> float:
    b, e, a = w.batch, w.element_size, w.acc_size
    q = b * heads * rows * w.head_dim * e
    out = b * heads * rows * w.v_head_dim * e
    kv = b * kv_heads * rows * (w.head_dim + w.v_head_dim) * e
    kv_acc = kv * a / e
    if rotate == "allgather":
        # The packed input; on gloo the all-gather runs as an all-to-all of
        # the input repeated N times (cplib/comm/collectives.py), a second copy.
        blocks = size * kv + kv + (size * kv if w.device_type == "cpu" else 0)
        if not w.backward:
            return out * a / e + blocks
        return 2 * out + q * a / e + (q + kv) + blocks + size * kv_acc + kv_acc
    if not w.backward:
        return out * a / e + 2 * kv
    return 2 * out + q * a / e + (q + kv) + 2 * kv + 2 * kv_acc


def _ulysses(w: Workload, degree: int) -> float:
    b, e = w.batch, w.element_size
    rows = w.seq_len / w.world_size
    q = b * w.q_heads * rows * w.head_dim * e
    out = b * w.q_heads * rows * w.v_head_dim * e
    kv = b * w.kv_heads_after(degree) * degree * rows * (w.head_dim + w.v_head_dim) * e
    heads_layout = q + kv + out  # the same bytes as this rank's shards
    if not w.backward:
        return heads_layout + out + max(q, out)
    return heads_layout + out + out + (q + kv) + max(q, kv, out)


def peak_memory(c: Candidate, w: Workload) -> float:
    """Predicted peak bytes per rank beyond the inputs (0 for a family this
    module does not know: its cost function should give its own)."""
    u = c.ulysses_degree
    if c.family == "ring":
        return _ring(w, w.seq_len / w.world_size, w.q_heads, w.kv_heads, w.world_size,
                     c.rotate or "p2p")
    if c.family == "ulysses":
        return _ulysses(w, u)
    if c.family == "usp":
        ring = _ring(w, w.seq_len * u / w.world_size, w.q_heads // u, w.kv_heads_after(u),
                     w.world_size // u, c.rotate or "p2p")
        rows = w.seq_len / w.world_size
        shards = w.batch * rows * w.element_size * (
            w.q_heads * w.head_dim + w.kv_heads_after(u) * u * (w.head_dim + w.v_head_dim))
        return ring + shards
    return 0.0
