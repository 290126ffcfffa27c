"""Which way a delta-rule layer exchanges under context parallelism, per call
("heads": head re-sharding; "state": state passing), and what each moves.

The choice follows the strategy's cost model (DESIGN.md section 13) with its
default rates for the device (``cplib.strategy.calibration``): bytes over the
link plus a fixed cost per collective, and for state passing the extra
kernel work of the ``d_k`` widened value columns (``WIDENED_UNIT_S``). Both
ways' bytes and work grow with the local length, so the choice mostly
follows the link's speed against the kernel's. It depends on shapes and
the layout alone, so every rank makes the same choice. ``recurrence_exchange``
forces one way for the code inside it (per thread, like a context variable).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass

from ..strategy.calibration import Calibration, default_for
from .layout import SequenceLayout

__all__ = ["DeltaShape", "recurrence_exchange", "choose_exchange", "exchange_costs"]

WAYS = ("auto", "heads", "state")
_forced: contextvars.ContextVar[str] = contextvars.ContextVar("cplib_recurrence_exchange",
                                                              default="auto")


@contextlib.contextmanager
def recurrence_exchange(way: str) -> Iterator[None]:
    """Inside the block, delta-rule layers under context parallelism exchange
    by ``"heads"`` (head re-sharding; raises ValueError where the linear key
    heads do not divide by the ranks), ``"state"`` (state passing) or
    ``"auto"`` (the default: the cheaper one by the cost model)."""
    if way not in WAYS:
        raise ValueError(f"cplib.hybrid.recurrence_exchange: way={way!r} is not one of {WAYS}")
    token = _forced.set(way)
    try:
        yield
    finally:
        _forced.reset(token)


@dataclass(frozen=True)
class DeltaShape:
    """One delta-rule call: batch, key heads, value heads, key and value head
    dims, the gate's width per value head (1 for GDN, d_k for KDA), and the
    element sizes of the projected streams and of the gate."""

    batch: int
    key_heads: int
    value_heads: int
    dk: int
    dv: int
    gate_width: int
    itemsize: int
    gate_itemsize: int = 4


# Seconds of extra kernel work per (token x value head x d_k x (64 + d_k)), the
# d_k value columns state passing adds to a chunked delta-rule kernel's
# forward + backward: on CPU measured with transformers' torch kernel (2
# cores, one thread per rank: 2e-10 to 6e-10 s); on CUDA an estimate for fla's
# kernels (about 6 FLOPs per unit at 60 TFLOP/s), not yet measured.
WIDENED_UNIT_S = {"cpu": 3e-10, "cuda": 1e-13}


def exchange_costs(layout: SequenceLayout, s: DeltaShape, cal: Calibration,
                   widened_unit_s: float) -> dict[str, dict[str, float]]:
    """Per way: bytes a rank receives in one forward + backward, and the
    predicted seconds that way adds to a forward + backward."""
    n, local = layout.world_size, max(layout.lengths())
    away = (n - 1) / n
    per_token = (2 * s.key_heads * s.dk + s.value_heads * s.dv + s.value_heads) * s.itemsize \
        + s.value_heads * s.gate_width * s.gate_itemsize
    # There and back, forward and backward; one all-to-all per dtype each way,
    # each with a handshake in the forward.
    heads_bytes = 2 * away * s.batch * local * (per_token + s.value_heads * s.dv * s.itemsize)
    groups = 1 if s.itemsize == s.gate_itemsize else 2
    heads_s = 6 * groups * cal.latency_s + heads_bytes / cal.link_bps
    # One handshake and one all-gather forward, one reduce-scatter backward.
    sent = layout.pieces_per_rank * s.batch * s.value_heads * s.dk * (s.dk + s.dv) * 4
    widened = s.batch * local * s.value_heads * (64 + s.dk) * s.dk
    state_s = 2 * cal.latency_s + (n - 1) * sent / cal.link_bps + cal.reduce_scatter_s \
        + (n - 1) * sent / cal.reduce_scatter_bps + widened * widened_unit_s
    return {"heads": {"bytes": heads_bytes, "time_s": heads_s},
            "state": {"bytes": 2 * (n - 1) * sent, "time_s": state_s}}


def choose_exchange(layout: SequenceLayout, s: DeltaShape, device_type: str,
                    need_state: bool = False) -> str:
    """"heads" or "state" for one call (the same on every rank)."""
    way = _forced.get()
    divides = s.key_heads % layout.world_size == 0
    if way == "heads":
        if not divides:
            raise ValueError(
                f"cplib: recurrence_exchange('heads') needs the linear key heads "
                f"({s.key_heads}) to divide by the {layout.world_size} context-parallel ranks; "
                "use 'state' or 'auto'")
        if need_state:
            raise NotImplementedError("cplib: recurrence_exchange('heads') cannot return the "
                                      "final recurrent state; use 'state' or 'auto'")
        return way
    if way == "state" or not divides or need_state or layout.world_size == 1:
        return "state"
    unit = WIDENED_UNIT_S["cuda" if device_type == "cuda" else "cpu"]
    costs = exchange_costs(layout, s, default_for(device_type), unit)
    return "heads" if costs["heads"]["time_s"] < costs["state"]["time_s"] else "state"
