"""What one kernel call of the ring costs: the cells its kernel computes (a
causal call skips whole key blocks only, so a short causal call costs as
much as a full one), times the measured rate, plus a fixed cost per call,
the mask an explicit-mask call builds, and the memory passes around the call
(the merge into the fp32 accumulators, dQ and dK|dV accumulation, K/V
expanded to q's heads for GQA)."""

from __future__ import annotations

from .calibration import Calibration
from .plan import CAUSAL, PARTIAL
from .workload import Workload

__all__ = ["kernel_cells", "call_seconds", "pass_seconds"]


def _splits(q_rows: int, device_type: str) -> tuple[int, int]:
    """(query rows, key rows) per block of the device's kernel. CPU: ATen's
    flash kernel (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp: 256
    query rows from 768 on, 64 from 192, else 32; 512 keys); CUDA: flash's
    tiles of 128 x 128."""
    if device_type != "cpu":
        return 128, 128
    return (256 if q_rows >= 768 else 64 if q_rows >= 192 else 32), 512


def kernel_cells(kind: int, q_rows: int, k_rows: int, device_type: str) -> float:
    """Query-key cells a call's kernel computes: every cell of a full or
    masked call; for a causal call (q_rows == k_rows), per block of query
    rows the key blocks up to its last row, whole (masked inside)."""
    if kind != CAUSAL:
        return float(q_rows * k_rows)
    qs, ks = _splits(q_rows, device_type)
    total = 0
    for m in range(0, q_rows, qs):
        rows = min(qs, q_rows - m)
        keys = min(m + rows, k_rows)
        total += rows * min(k_rows, -(-keys // ks) * ks)
    return float(total)


def call_seconds(kind: int, q_rows: int, k_rows: int, w: Workload, cal: Calibration,
                 heads: int, kv_heads: int) -> float:
    """Seconds of one call (fwd+bwd, or fwd only) of ``q_rows`` queries of
    ``heads`` heads against ``k_rows`` keys of ``kv_heads`` heads, with the
    memory passes around it. On CPU: this rank's CPU seconds."""
    d = w.head_dim + w.v_head_dim
    scale = 1.0 if w.backward else cal.fwd_fraction
    units = w.batch * heads * d
    if kind == PARTIAL:
        area = q_rows * k_rows
        kernel = cal.masked_unit_s * area * units + cal.mask_s * area
    else:
        kernel = cal.unit_s * kernel_cells(kind, q_rows, k_rows, w.device_type) * units
    return scale * (kernel + cal.call_s) + pass_seconds(q_rows, k_rows, w, cal, heads, kv_heads)


def pass_seconds(q_rows: int, k_rows: int, w: Workload, cal: Calibration, heads: int,
                 kv_heads: int) -> float:
    """Seconds of the memory passes around one call (a flex ring's calls
    make the same ones)."""
    d = w.head_dim + w.v_head_dim
    a, e, b = w.acc_size, w.element_size, w.batch
    # The forward merges the call's (out, lse) into the accumulators; the
    # backward adds dQ rows and the block's dK|dV rows (summed over a GQA
    # group); K/V are expanded to q's heads per call for GQA (fwd and bwd).
    passes = b * heads * q_rows * w.v_head_dim * (2 * a + e)
    if w.backward:
        passes += b * heads * q_rows * w.head_dim * 3 * a + b * heads * k_rows * d * 2 * a
    if heads != kv_heads:
        passes += b * heads * k_rows * d * e * (2 if w.backward else 1)
    return passes / cal.copy_bps
