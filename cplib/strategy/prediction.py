"""What the model predicts for one candidate (cost.py prices it): its time on
the slowest rank in parts, the bytes a rank sends and its peak memory."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Prediction"]


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
