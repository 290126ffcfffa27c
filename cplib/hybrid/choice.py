"""Which way a delta-rule layer exchanges under context parallelism, per call
("heads": head re-sharding; "state": state passing), and what each moves.

The choice follows the strategy's cost model (DESIGN.md section 13) with its
calibrated rates for the device (``cplib.strategy.calibration``): bytes over
the link plus a fixed cost per collective, and for state passing the extra
kernel work of the ``d_k`` widened value columns. It depends on shapes and
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


def exchange_costs(layout: SequenceLayout, s: DeltaShape,
                   cal: Calibration) -> dict[str, dict[str, float]]:
    """Per way: bytes a rank sends in one forward, and the predicted seconds
    of a forward + backward beyond the local kernel."""
    n, local = layout.world_size, max(layout.lengths())
    away = (n - 1) / n
    per_token = (2 * s.key_heads * s.dk + s.value_heads * s.dv + s.value_heads) * s.itemsize \
        + s.value_heads * s.gate_width * s.gate_itemsize
    heads_bytes = away * s.batch * local * (per_token + s.value_heads * s.dv * s.itemsize)
    state_bytes = layout.pieces_per_rank * s.batch * s.value_heads * s.dk * (s.dk + s.dv) * 4
    # Widened columns: the chunked kernel's work per token and head grows by
    # about (chunk + d_k) * d_k; priced like attention work (unit_s, fwd+bwd).
    widened = s.batch * local * s.value_heads * (64 + s.dk) * s.dk * cal.unit_s
    heads_s = 2 * (2 * cal.latency_s + heads_bytes / cal.link_bps)
    state_s = 2 * (cal.latency_s + (n - 1) * state_bytes / cal.link_bps) + widened
    return {"heads": {"bytes_sent": heads_bytes, "time_s": heads_s},
            "state": {"bytes_sent": state_bytes, "time_s": state_s}}


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
    costs = exchange_costs(layout, s, default_for(device_type))
    return "heads" if costs["heads"]["time_s"] < costs["state"]["time_s"] else "state"
