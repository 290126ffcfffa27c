"""Where one ring step's wall time goes, read from torch.profiler: the
device's kernels split into attention kernels, the collectives' copies (the
threaded group's all-to-alls and gathers: on N GPUs these are the link's
work), other kernels (merges, casts, copies, adds) and the device's idle
time; and each rank's own kernel time and the bytes it sent, which
ring_blocks.projection turns into a time on N GPUs.

How it is read. Every rank runs one step under a marker
(``bench.rank<r>``, the step and its device synchronisation) while one
profiler records every thread of the process (``profile_all_threads``). The
wall time is the span of the markers. A kernel belongs to the CPU op that
launched it (torch's ``FunctionEvent.kernels``), classified by that op and
its callers: ``c10d``/``nccl`` names make it a collective's, ``attention``
names (ATen's flash, efficient and cuDNN ops, cplib's cuDNN op, SDPA) an
attention kernel. Its rank is the marker among its callers, or, for the
backward, which the autograd engine runs on its own device thread on CUDA,
the rank whose thread created the autograd node (the op's ``fwd_thread``).
The busy time is the union of the device's kernel intervals inside the wall
window, the idle time what is left of the window.

On the CPU (``--device cpu``, the rehearsal) the "kernels" are the leaf CPU
ops: the same classification, attribution and arithmetic, on what the CPU
ran. Imported by ring_timing.py."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

MARK = "bench.rank"
CLASSES = ("attention", "other", "comm")
_COMM = ("c10d", "nccl", "record_param_comms")
_ATTENTION = ("attention",)


def start_profiler(device: torch.device):
    """A started profiler recording every thread (CPU ops, and the device's
    kernels on CUDA)."""
    from torch.profiler import ProfilerActivity, _ExperimentalConfig, profile
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    prof = profile(activities=activities,
                   experimental_config=_ExperimentalConfig(profile_all_threads=True))
    prof.__enter__()
    return prof


def _chain(op) -> Iterator[Any]:
    while op is not None:
        yield op
        op = op.cpu_parent


def classify(names: list[str]) -> str:
    """A kernel's class from the names of the op that launched it and its
    callers (innermost first)."""
    low = [n.lower() for n in names]
    if any(c in n for n in low for c in _COMM):
        return "comm"
    if any(a in n for n in low for a in _ATTENTION):
        return "attention"
    return "other"


def _rank_of(chain: list, thread_rank: dict[int, int]) -> int | None:
    for op in chain:
        if op.name.startswith(MARK):
            return int(op.name[len(MARK):])
    for op in chain:  # the autograd engine's thread: the node's creator
        fwd = getattr(op, "fwd_thread", None)
        if fwd in thread_rank:
            return thread_rank[fwd]
    return thread_rank.get(chain[-1].thread) if chain else None


def _union(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    total, end = 0.0, lo
    for a, b in sorted(intervals):
        a, b = max(a, end), min(b, hi)
        if b > a:
            total += b - a
            end = b
    return total


def split(events, device_type: str, world_size: int) -> dict:
    """The split of one profiled step (seconds): wall, busy, idle, each
    class's kernel time over all ranks, each rank's own kernel time per
    class, the kernel time no rank could be found for, and the count of
    kernels."""
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    marks = [e for e in cpu if e.name.startswith(MARK)]
    if len(marks) != world_size:
        raise RuntimeError(f"profile: {len(marks)} rank markers, expected {world_size}")
    lo = min(m.time_range.start for m in marks)
    hi = max(m.time_range.end for m in marks)
    thread_rank = {m.thread: int(m.name[len(MARK):]) for m in marks}
    cuda = device_type == "cuda"
    per_rank = [{c: 0.0 for c in CLASSES} for _ in range(world_size)]
    totals = {c: 0.0 for c in CLASSES}
    unattributed, count, spans = 0.0, 0, []
    for op in cpu:
        if op.name.startswith(MARK):
            continue
        if cuda:
            durations = [k.duration for k in op.kernels]
        elif not op.cpu_children:  # the CPU's "kernels": its leaf ops
            durations = [op.time_range.end - op.time_range.start]
            spans.append((op.time_range.start, op.time_range.end))
        else:
            continue
        if not durations:
            continue
        chain = list(_chain(op))
        kind, rank, us = classify([o.name for o in chain]), _rank_of(chain, thread_rank), \
            sum(durations)
        count += len(durations)
        totals[kind] += us
        if rank is None:
            unattributed += us
        else:
            per_rank[rank][kind] += us
    if cuda:
        spans = [(e.time_range.start, e.time_range.end) for e in events
                 if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = _union(spans, lo, hi)
    s = 1e-6  # the profiler's times are microseconds
    return dict(wall_s=(hi - lo) * s, busy_s=busy * s, idle_s=(hi - lo - busy) * s,
                **{f"{c}_s": totals[c] * s for c in CLASSES},
                per_rank=[{f"{c}_s": r[c] * s for c in CLASSES} for r in per_rank],
                unattributed_s=unattributed * s, kernels=count)


# ---------------------------------------------------------------- bytes each rank sends


class WireBytes:
    """Floating-point payload bytes each rank of torch's threaded group sent
    to the other ranks, counted in the group's own collectives (which
    cplib's ring and torch's ring both end in): the all-to-alls, gathers and
    reduce-scatters; barriers and all-reduces are not counted."""

    def __init__(self, world_size: int) -> None:
        self.sent = [0] * world_size
        self._lock = threading.Lock()

    def add(self, rank: int, nbytes: int) -> None:
        with self._lock:
            self.sent[rank] += nbytes

    def take(self) -> list[int]:
        with self._lock:
            out, self.sent = self.sent, [0] * len(self.sent)
            return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size() if t.is_floating_point() else 0


def _even(n: int, rows: int) -> list[int]:
    return [rows // n] * n


@contextlib.contextmanager
def counting_wire(world_size: int) -> Iterator[WireBytes]:
    """Counts into a WireBytes while the block runs (install it in the main
    thread, before the rank threads start: it patches the threaded group's
    class)."""
    from torch.testing._internal.distributed.multi_threaded_pg import ProcessLocalGroup as G
    wire = WireBytes(world_size)
    real = {name: getattr(G, name) for name in
            ("all_to_all_single", "alltoall", "allgather", "reduce_scatter")}

    def all_to_all_single(self, out, inp, out_splits, in_splits, *args, **kwargs):
        if inp.numel():
            splits = list(in_splits) if in_splits else _even(self.size(), inp.shape[0])
            row = _nbytes(inp) // inp.shape[0]
            wire.add(self.rank(), row * sum(x for j, x in enumerate(splits) if j != self.rank()))
        return real["all_to_all_single"](self, out, inp, out_splits, in_splits, *args, **kwargs)

    def alltoall(self, outs, ins, *args, **kwargs):
        wire.add(self.rank(), sum(_nbytes(t) for j, t in enumerate(ins) if j != self.rank()))
        return real["alltoall"](self, outs, ins, *args, **kwargs)

    def allgather(self, outs, ins, *args, **kwargs):
        wire.add(self.rank(), (self.size() - 1) * sum(_nbytes(t) for t in ins))
        return real["allgather"](self, outs, ins, *args, **kwargs)

    def reduce_scatter(self, out, scatter, *args, **kwargs):
        chunks = [t for group in scatter for j, t in enumerate(group) if j != self.rank()]
        wire.add(self.rank(), sum(_nbytes(t) for t in chunks))
        return real["reduce_scatter"](self, out, scatter, *args, **kwargs)
    for name, fn in (("all_to_all_single", all_to_all_single), ("alltoall", alltoall),
                     ("allgather", allgather), ("reduce_scatter", reduce_scatter)):
        setattr(G, name, fn)
    try:
        yield wire
    finally:
        for name, fn in real.items():
            setattr(G, name, fn)


# ---------------------------------------------------------------- one profiled step


def profiled_step(step, sync, barrier, device: torch.device, shared: dict,
                  wire: WireBytes | None) -> dict | None:
    """Runs ``step`` once on every rank under the profiler (each rank calls
    this at the same point); rank 0 returns the split with each rank's bytes
    sent (``sent_bytes``), or ``{"error": ...}``, the other ranks None.
    ``shared``: one dict for all ranks of the cell (holds the profiler)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    sync()
    barrier()
    if rank == 0:
        try:
            shared["prof"] = start_profiler(device)
        except Exception as exc:  # noqa: BLE001 - a profiler that cannot start is reported
            shared["error"] = f"profiler: {type(exc).__name__}: {exc}"[:200]
        if wire is not None:
            wire.take()
    barrier()
    with torch.profiler.record_function(f"{MARK}{rank}"):
        step()
        sync()
    barrier()
    if rank != 0:
        return None
    if "error" in shared:
        return {"error": shared.pop("error")}
    prof = shared.pop("prof")
    try:
        prof.__exit__(None, None, None)
        out = split(prof.events(), device.type, n)
    except Exception as exc:  # noqa: BLE001 - the split's failure is the cell's note
        return {"error": f"profile: {type(exc).__name__}: {exc}"[:200]}
    out["sent_bytes"] = wire.take() if wire is not None else None
    return out
