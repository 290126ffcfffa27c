"""The choice: every admitted candidate costed, the fastest that fits the
memory limit taken (ties to the earlier-registered one), made once per
(workload, constraints, group) and cached, and agreed across the group's
ranks: the first time, the ranks exchange a hash of what they are choosing
for (the handshake raises the same ValueError on every rank if it differs)
and the index of their choice, and every rank takes rank 0's. The calibration
is agreed the same way, once per (device type, group, head dim, dtype)."""

from __future__ import annotations

import hashlib
import logging
import warnings
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.distributed as dist

from ..comm.handshake import agreed, can_handshake, handshake, tracing
from .calibration import DEFAULTS, Calibration, as_calibration, default_for
from .candidates import Candidate, Constraints, candidates_for
from .cost import predict
from .prediction import Prediction
from .workload import Workload

__all__ = ["Row", "Choice", "choose", "format_choice", "agreed_choice", "calibration_for",
           "clear_caches", "stable_hash", "every_rank"]

log = logging.getLogger("cplib")


@dataclass(frozen=True)
class Row:
    candidate: Candidate
    prediction: Prediction
    fits: bool


@dataclass(frozen=True)
class Choice:
    """The candidates costed for one workload (fastest first), the one chosen
    and what it was chosen on. ``str(choice)`` is the table (explain.py)."""

    workload: Workload
    calibration: Calibration
    constraints: Constraints
    rows: tuple[Row, ...]
    chosen: Candidate
    candidates: tuple[Candidate, ...] = ()  # in registration order (what ranks index)

    @property
    def prediction(self) -> Prediction:
        return next(r.prediction for r in self.rows if r.candidate == self.chosen)

    def __str__(self) -> str:
        return format_choice(self)


def _mib(x: float) -> str:
    return f"{x / 2 ** 20:.4g}"


def format_choice(choice: Choice) -> str:
    """The markdown table of a choice: one row per candidate, fastest first,
    ``*`` on the chosen one, ``(over limit)`` where memory rules it out."""
    w = choice.workload
    head = (f"cplib strategy: S={w.seq_len} B={w.batch} heads {w.q_heads}/{w.kv_heads} "
            f"D={w.head_dim} {w.mask_kind()} on {w.world_size} ranks ({w.ranks_per_node} per "
            f"node), {'fwd+bwd' if w.backward else 'fwd'}; calibration: "
            f"{choice.calibration.name}")
    lines = [head, "",
             "|   | candidate | time ms | compute ms | exposed exchange ms | fixed ms | "
             "MiB sent/rank | peak MiB/rank |",
             "|---|-----------|---------|------------|---------------------|----------|"
             "---------------|---------------|"]
    for r in choice.rows:
        p = r.prediction
        mark = "*" if r.candidate == choice.chosen else ""
        name = r.candidate.name + ("" if r.fits else " (over limit)")
        lines.append(f"| {mark} | {name} | {p.time_s * 1e3:.4g} | {p.compute_s * 1e3:.4g} | "
                     f"{p.exposed_s * 1e3:.4g} | {p.fixed_s * 1e3:.4g} | {_mib(p.bytes_sent)} | "
                     f"{_mib(p.memory_bytes)} |")
    fastest = min((r for r in choice.rows if r.fits), key=lambda r: r.prediction.time_s)
    gain = choice.prediction.time_s / fastest.prediction.time_s - 1
    if fastest.candidate != choice.chosen and gain > 0:
        lines.append(f"\nkept torch's default ({choice.chosen.name}): {fastest.candidate.name} "
                     f"is predicted only {gain:.1%} faster (margin "
                     f"{choice.constraints.margin:.0%})")
    return "\n".join(lines)


def stable_hash(value: object) -> int:
    """A 63-bit hash of ``repr(value)``, the same in every process (Python's
    own string hashes are salted per process)."""
    digest = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2 ** 63 - 1)


def choose(w: Workload, cal: Calibration, constraints: Constraints = Constraints()) -> Choice:
    """The candidate with the least predicted time among those
    ``constraints`` admit and whose predicted peak memory fits
    ``constraints.memory_limit`` (torch's default, the ring with all-gather,
    or for flex the flex all-gather, when it is within ``constraints.margin``
    of it); ValueError when none is admitted or none
    fits (naming the limit and the smallest prediction). Pure: no
    communication, the same result on every rank for the same inputs."""
    cands = candidates_for(w, constraints)
    if not cands:
        raise ValueError(f"cplib.strategy: no candidate applies to this call (constraints "
                         f"{constraints}, {w.world_size} ranks, {w.q_heads}/{w.kv_heads} heads)")
    limit = constraints.memory_limit
    rows = [Row(c, p, limit is None or p.memory_bytes <= limit)
            for c, p in ((c, predict(c, w, cal)) for c in cands)]
    fitting = [r for r in rows if r.fits]
    if not fitting:
        least = min(rows, key=lambda r: r.prediction.memory_bytes)
        raise ValueError(
            f"cplib.strategy: no candidate fits memory_limit={limit} bytes per rank; the "
            f"smallest predicted peak is {least.prediction.memory_bytes:.0f} bytes "
            f"({least.candidate.name}); raise the limit or use more ranks")
    best = min(fitting, key=lambda r: (r.prediction.time_s, cands.index(r.candidate)))
    default = next((r for r in fitting if r.candidate.family in ("ring", "flex")
                    and r.candidate.rotate == "allgather"), None)
    if default is not None and \
            default.prediction.time_s <= best.prediction.time_s * (1 + constraints.margin):
        best = default  # not enough predicted gain to leave torch's default
    ordered = sorted(rows, key=lambda r: (r.prediction.time_s, cands.index(r.candidate)))
    return Choice(w, cal, constraints, tuple(ordered), best.candidate, tuple(cands))


# ---------------------------------------------------------------- agreed, cached

_choices: dict[tuple, Choice] = {}
_calibrations: dict[tuple, Calibration] = {}


def clear_caches() -> None:
    """Forgets every cached choice and calibration of this process."""
    _choices.clear()
    _calibrations.clear()


def _exchange(group_name: str | None, op: str, fields: dict[str, int],
              values: list[int]) -> list[list[int]] | None:
    """Every rank's ``values`` through the handshake (ValueError on every rank
    when ``fields`` differ), or None where no handshake runs (a world of one,
    a trace, checks off)."""
    if group_name is None or not can_handshake(group_name):
        return None
    return handshake(group_name, op, fields=fields, lengths=values)


def _exchange_unchecked(group_name: str, values: list[int]) -> list[list[int]]:
    """Every rank's ``values`` when the handshake is off (all_gather_object)."""
    pg = dist.distributed_c10d._resolve_process_group(group_name)
    out: list = [None] * dist.get_world_size(pg)
    dist.all_gather_object(out, values, group=pg)
    return out


def every_rank(group_name: str | None, op: str, fields: dict[str, int],
               values: list[int]) -> list[list[int]]:
    """Every rank's ``values``, in rank order, through the handshake
    (ValueError on every rank when ``fields`` differ; all_gather_object when
    the handshake is off); ``[values]`` where nothing communicates (a world of
    one, a trace)."""
    if not _communicates(group_name):
        return [values]
    return _exchange(group_name, op, fields, values) or _exchange_unchecked(group_name, values)


def _communicates(group_name: str | None) -> bool:
    from ..comm.native import group_size

    if group_name is None or tracing() or not dist.is_initialized():
        return False
    try:
        return group_size(group_name) > 1
    except ValueError:
        return False


def calibration_for(group_name: str | None, device: torch.device, head_dim: int,
                    dtype: torch.dtype, given: object = None) -> Calibration:
    """``given`` (a Calibration, a default's name or overrides), else the
    cached agreed one of (device type, group, head dim, dtype), else one
    measured now on every rank of the group and agreed (collective: every rank
    calls this at the same point), else (a trace, meta tensors, no group) the
    device's built-in default."""
    if given is not None:
        return as_calibration(given, device.type)
    key = (device.type, group_name, int(head_dim), str(dtype))
    if key in _calibrations:
        return _calibrations[key]
    if device.type not in ("cpu", "cuda") or not _communicates(group_name):
        return default_for(device.type)
    from .microbench import CalibrationFailed, agree, measure

    fields = {"calibration head_dim": int(head_dim), "calibration dtype": stable_hash(dtype)}

    def exchange(ints: list[int]) -> list[list[int]]:
        return (_exchange(group_name, "strategy calibration", fields, ints)
                or _exchange_unchecked(group_name, ints))
    # A handshake first: a rank whose call failed its checks tells the others
    # here, before any collective of the measurement.
    _exchange(group_name, "strategy calibration", fields, [])
    try:
        cal = agree(measure(dist.distributed_c10d._resolve_process_group(group_name), device,
                            head_dim, dtype, exchange), exchange)
    except CalibrationFailed as failed:  # on every rank alike
        cal = _fallback(group_name, device, failed)
    _calibrations[key] = cal
    log.info("cplib.strategy: calibrated %s for group %s (head_dim %d, %s): %s", device.type,
             group_name, head_dim, dtype, cal)
    return cal


def _fallback(group_name: str, device: torch.device, failed: Exception) -> Calibration:
    """The device's built-in calibration, when measuring failed on some rank
    (the same on every rank, and said so once per calibration key)."""
    base = default_for(device.type)
    name = next(k for k, v in DEFAULTS.items() if v is base)
    message = (f"cplib.strategy: measuring the calibration over group '{group_name}' failed "
               f"({failed}); every rank uses the built-in calibration '{name}' instead (pass "
               "AutoStrategy(calibration=...) to give one)")
    warnings.warn(message, RuntimeWarning, stacklevel=2)
    log.warning(message)
    return replace(base, name=f"{base.name}, after a failed measurement")


def agreed_choice(group_name: str | None, w: Workload, constraints: Constraints,
                  calibration: Callable[[], Calibration],
                  full: Callable[[], Workload] | None = None) -> Choice:
    """:func:`choose`, cached per (group, workload key, constraints) and
    agreed: on a miss every rank of the group exchanges a hash of the key and
    the index of its choice, and takes rank 0's. Logged once at INFO on the
    ``cplib`` logger. ``full()``: the workload to cost on a miss when ``w``
    stands for it in the key only (documents read lazily)."""
    key = (group_name, w.key(), constraints)
    found = _choices.get(key)
    if found is not None:
        return found
    if full is not None:
        w = full()
    # Bad input (no candidate admitted, or none within the memory limit)
    # raises here, before the calibration's collectives, and on every rank:
    # the error travels in the handshake the other ranks make next. What a
    # candidate needs in memory does not depend on the rates.
    agreed("strategy choice", group_name if _communicates(group_name) else None, [],
           lambda: choose(w, default_for(w.device_type), constraints))
    cal = calibration()
    choice = choose(w, cal, constraints)
    order = list(choice.candidates)  # the same on every rank (not the time order)
    if _communicates(group_name):
        fields = {"strategy workload (hash)": stable_hash((w.key(), constraints)),
                  "strategy candidates (hash)": stable_hash(order)}
        values = [order.index(choice.chosen)]
        every = _exchange(group_name, "strategy choice", fields, values) or \
            _exchange_unchecked(group_name, values)
        if every[0][0] != values[0]:
            choice = Choice(w, cal, constraints, choice.rows, order[every[0][0]], choice.candidates)
    _choices[key] = choice
    p = choice.prediction
    log.info("cplib.strategy: %s for S=%d B=%d heads %d/%d D=%d %s on %d ranks (%d per node): "
             "predicted %.3g ms, %.3g MiB sent, %.3g MiB peak per rank",
             choice.chosen.name, w.seq_len, w.batch, w.q_heads, w.kv_heads, w.head_dim,
             w.mask_kind(), w.world_size, w.ranks_per_node, p.time_s * 1e3,
             p.bytes_sent / 2 ** 20, p.memory_bytes / 2 ** 20)
    return choice
