"""The calibration microbenchmark: on every rank of a group at once, a few
fwd+bwd attention calls (two sizes, and one with an explicit mask), a memory
copy, and one exchange of the group at two sizes (plus a reduce-scatter, and
the large exchange in flight under the large attention call, for the
overlap). Well under 2 s on the 2-core CPU machine (measured in
benchmarks/bench_strategy.py). The ranks then agree on one result (the
slowest rate and the largest fixed cost of any rank), so that every rank
predicts, and chooses, alike."""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .calibration import Calibration, default_for
from .workload import ranks_per_node

__all__ = ["measure", "agree", "CalibrationFailed"]

# (heads, small rows, large rows, masked rows, exchange bytes small / large) per device type.
_SIZES = {"cpu": (4, 128, 640, 768, 4096, 2 << 20),
          "cuda": (8, 512, 4096, 2048, 4096, 64 << 20)}


def _timed(fn: Callable[[], object], sync: Callable[[], None], reps: int = 3,
           clock: Callable[[], float] = time.perf_counter) -> float:
    """Median seconds of ``fn`` after one warm-up, on ``clock``."""
    fn()
    sync()
    times = []
    for _ in range(reps):
        sync()
        t0 = clock()
        fn()
        sync()
        times.append(clock() - t0)
    return statistics.median(times)


def contention(local_ranks: int) -> float:
    """Wall seconds per CPU second of a rank's compute when ``local_ranks``
    ranks of ``torch.get_num_threads()`` threads each share this machine's
    cores (4 ranks of one thread on 2 cores: 2)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1.0, local_ranks * torch.get_num_threads() / max(cores or 1, 1))


def _attention(heads: int, rows: int, head_dim: int, dtype: torch.dtype, device: torch.device,
               masked: bool) -> Callable[[], None]:
    """One fwd+bwd: square (rows x rows), or as the ring runs a partial
    block: a tile of 256 query rows against ``rows`` keys with an explicit
    mask built for the call, forward and backward (a band and a document
    boundary, as ring_mask.cpp builds it)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    q_rows = 256 if masked else rows
    q, k, v = (torch.randn(1, heads, n, head_dim, generator=g).to(device, dtype)
               .requires_grad_() for n in (q_rows, rows, rows))
    kpos = torch.arange(rows, device=device)
    qpos = torch.arange(rows - q_rows, rows, device=device)
    kdoc, qdoc = (kpos >= rows // 3).long(), (qpos >= rows // 3).long()

    def mask() -> torch.Tensor | None:
        if not masked:
            return None
        visible = (kpos[None, :] >= qpos[:, None] - rows // 2) & (kpos[None, :] <= qpos[:, None])
        visible &= kdoc[None, :] == qdoc[:, None]
        visible.any(1)  # the rows that see nothing (the ring fixes them up)
        return torch.where(visible, 0.0, float("-inf")).to(dtype)

    def run() -> None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask())
        mask()  # the backward builds it again
        out.backward(torch.ones_like(out))
    run.mask = mask  # type: ignore[attr-defined]
    return run


class CalibrationFailed(RuntimeError):
    """The measurement failed on some rank; raised on every rank alike."""


class _Exchange:
    """The buffers of the group's exchanges, made before any of them (an
    allocation that fails is then a local failure, agreed on before the
    first collective): an all-to-all and a reduce-scatter at two sizes."""

    def __init__(self, n: int, device: torch.device, sizes: tuple[int, int]) -> None:
        def numel(nbytes: int) -> int:
            return max(nbytes // 4 // n, 1)
        self.a2a = {b: (torch.empty(numel(b) * n, device=device),
                        torch.ones(numel(b) * n, device=device)) for b in sizes}
        self.rs = {b: (torch.empty(numel(b), device=device),
                       torch.ones(numel(b) * n, device=device)) for b in sizes}


def _exchange_rates(group: dist.ProcessGroup, buffers: _Exchange, xs: int, xl: int,
                    barrier: Callable[[], None], attn_large: Callable[[], None]) -> tuple:
    """(seconds per collective, link bytes/s, reduce-scatter bytes/s and fixed
    seconds, overlap) of the group: its all-to-all at two sizes, a
    reduce-scatter at two sizes, and the large all-to-all in flight under
    the large attention call. Every rank makes every collective:
    ``attn_large`` must not raise (see _guarded)."""
    n = dist.get_world_size(group)

    def exchange(nbytes: int, async_op: bool = False):
        out, inp = buffers.a2a[nbytes]
        return dist.all_to_all_single(out, inp, group=group, async_op=async_op)

    t_xs = _timed(lambda: exchange(xs), barrier, reps=5)
    t_xl = _timed(lambda: exchange(xl), barrier, reps=2)
    link_bps = (xl - xs) * (n - 1) / n / max(t_xl - t_xs, 1e-9)
    latency_s = max(t_xs - xs * (n - 1) / n / link_bps, 0.0)
    # reduce_scatter_single from torch 2.13 on (the older name warns there).
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def reduce_scatter(nbytes: int) -> None:
        rs(*buffers.rs[nbytes], group=group)
    t_rs_small = _timed(lambda: reduce_scatter(xs), barrier, reps=5)
    t_rs = _timed(lambda: reduce_scatter(xl), barrier, reps=2)
    rs_bps = (xl - xs) / max(t_rs - t_rs_small, 1e-9)
    rs_s = max(t_rs_small - xs / rs_bps, 0.0)

    def both() -> None:
        work = exchange(xl, async_op=True)
        attn_large()
        work.wait()
    t_both = _timed(both, barrier, reps=2)
    t_attn = _timed(attn_large, barrier, reps=2)  # its wall time, as in both()
    overlap = min(max((t_attn + t_xl - t_both) / max(min(t_attn, t_xl), 1e-9), 0.0), 1.0)
    return latency_s, link_bps, rs_bps, rs_s, overlap


def _local_rates(group: dist.ProcessGroup, kind: str, device: torch.device, head_dim: int,
                 dtype: torch.dtype) -> tuple[dict, Callable[[], None]]:
    """This rank's kernel and copy rates (no collective), and its large
    attention call (the exchange phase runs it again)."""
    heads, small, large, masked_rows, xs, xl = _SIZES[kind]
    sync = torch.cuda.synchronize if kind == "cuda" else (lambda: None)
    # CPU: the kernels' CPU time (free of the scheduler's time slices, which
    # swamp a small call when ranks outnumber cores), and how many ranks
    # compute at full speed at once: the local ranks over the wall seconds
    # per CPU second of the large call that every rank runs at once (other
    # jobs' load counts too; at most the cores).
    clock = time.perf_counter if kind == "cuda" else time.process_time
    attn_large = _attention(heads, large, head_dim, dtype, device, False)
    t_large = _timed(attn_large, sync, clock=clock)
    cores = 0.0
    if kind == "cpu":
        local = ranks_per_node(dist.get_world_size(group))
        wall = _timed(attn_large, sync, reps=2)
        share = max(contention(local), wall / max(t_large, 1e-9))
        cores = local / share
    d = 2 * head_dim

    def attention(rows: int, masked: bool, fn=None) -> float:
        fn = fn or _attention(heads, rows, head_dim, dtype, device, masked)
        return _timed(fn, sync, clock=clock)
    t_small = attention(small, False)
    units_small, units_large = heads * small * small * d, heads * large * large * d
    unit_s = max((t_large - t_small) / (units_large - units_small), 1e-18)
    call_s = max(t_small - units_small * unit_s, 0.0)
    tile = _attention(heads, masked_rows, head_dim, dtype, device, True)
    # Building a tile's mask, per element (twice a fwd+bwd), apart from its
    # kernel (per head): calls of few heads pay it relatively more.
    area = 256 * masked_rows
    mask_s = 2 * attention(masked_rows, True, tile.mask) / area
    t_masked = attention(masked_rows, True, tile)
    masked_unit_s = max((t_masked - call_s - mask_s * area) / (heads * area * d), unit_s)

    buf = torch.empty(xl // 4, dtype=torch.float32, device=device)
    other = torch.empty_like(buf)
    copy_bps = 2 * xl / max(_timed(lambda: other.copy_(buf), sync, clock=clock), 1e-9)
    return dict(unit_s=unit_s, masked_unit_s=masked_unit_s, mask_s=mask_s, call_s=call_s,
                copy_bps=copy_bps, cores=cores), attn_large


def _guarded(fn: Callable[[], None], failures: list[str]) -> Callable[[], None]:
    """``fn`` that records its error instead of raising it (once it failed,
    it is not run again), so that this rank still makes every collective."""
    def run() -> None:
        if failures:
            return
        try:
            fn()
        except Exception as exc:  # noqa: BLE001  (reported to every rank by _agree_ok)
            failures.append(f"{type(exc).__name__}: {exc}")
    return run


def _agree_ok(group: dist.ProcessGroup, failures: list[str],
              exchange: Callable[[list[int]], list[list[int]]]) -> None:
    """Every rank learns whether any rank failed; if one did, every rank
    raises the same CalibrationFailed, naming each failed rank's error."""
    if not any(row[0] for row in exchange([int(bool(failures))])):
        return
    texts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(texts, failures[0] if failures else None, group=group)
    raise CalibrationFailed("; ".join(f"rank {r}: {t}" for r, t in enumerate(texts)
                                      if t is not None))


def measure(group: dist.ProcessGroup, device: torch.device, head_dim: int, dtype: torch.dtype,
            exchange: Callable[[list[int]], list[list[int]]]) -> Calibration:
    """This rank's measured Calibration (collective: every rank of ``group``
    calls it at the same point; ``exchange(ints)`` returns every rank's
    ints). Runs alike under no_grad, inference_mode or autograd, and leaves
    the caller's mode as it was. An error on any rank (an out-of-memory error
    say) raises CalibrationFailed on every rank, agreed before the first
    collective of the measurement (its buffers are made before it) or after
    the last."""
    kind = "cuda" if device.type == "cuda" else "cpu"
    xs, xl = _SIZES[kind][4:]
    n = dist.get_world_size(group)
    failures: list[str] = []
    # Its own autograd graph, whatever the caller's mode (the first CP call
    # of a process may come in evaluation); the caller's mode is restored.
    with torch.inference_mode(False), torch.enable_grad():
        try:
            measured, attn_large = _local_rates(group, kind, device, head_dim, dtype)
            buffers = _Exchange(n, device, (xs, xl)) if n > 1 else None
        except Exception as exc:  # noqa: BLE001  (reported to every rank by _agree_ok)
            failures.append(f"{type(exc).__name__}: {exc}")
        _agree_ok(group, failures, exchange)
        ref = default_for(kind)
        rates = (ref.latency_s, ref.link_bps, ref.reduce_scatter_bps, ref.reduce_scatter_s,
                 ref.overlap)
        if buffers is not None:
            barrier = (lambda: dist.barrier(group)) if kind == "cpu" else torch.cuda.synchronize
            rates = _exchange_rates(group, buffers, xs, xl, barrier,
                                    _guarded(attn_large, failures))
            _agree_ok(group, failures, exchange)
    latency_s, link_bps, rs_bps, rs_s, overlap = rates
    return Calibration(f"measured ({kind}, {n} ranks)", **measured, latency_s=latency_s,
                       link_bps=link_bps, inter_node_bps=min(ref.inter_node_bps, link_bps),
                       reduce_scatter_bps=rs_bps, reduce_scatter_s=rs_s, overlap=overlap,
                       fwd_fraction=ref.fwd_fraction)


# Calibration fields agreed across ranks: (name, worse is larger, scale to an int).
_AGREED = (("unit_s", True, 1e21), ("masked_unit_s", True, 1e21), ("mask_s", True, 1e21),
           ("call_s", True, 1e12),
           ("copy_bps", False, 1.0), ("latency_s", True, 1e12), ("link_bps", False, 1.0),
           ("reduce_scatter_bps", False, 1.0), ("reduce_scatter_s", True, 1e12),
           ("overlap", False, 1e6), ("cores", False, 1e6))


def agree(cal: Calibration, exchange: Callable[[list[int]], list[list[int]]]) -> Calibration:
    """One Calibration for every rank: ``exchange(ints)`` returns every
    rank's ints (the handshake); each field takes its worst value over the
    ranks (largest time, smallest rate), so every rank predicts alike."""
    mine = [int(round(getattr(cal, name) * scale)) for name, _, scale in _AGREED]
    every = exchange(mine)
    values = cal.as_dict()
    for i, (name, larger_is_worse, scale) in enumerate(_AGREED):
        column = [row[i] for row in every]
        values[name] = (max(column) if larger_is_worse else min(column)) / scale
    values["inter_node_bps"] = min(values["inter_node_bps"], values["link_bps"])
    values["name"] = cal.name + ", agreed"
    return Calibration(**values)
