"""Shared benchmark plumbing: timing, the printed table, JSON and a PNG plot.

Every benchmark compares against a baseline measured in the same run (the
single-process full computation, and torch's own implementation where it
runs), prints a table, and writes ``<name>.json`` and ``<name>.png`` under
``benchmarks/out/`` (or ``$CPLIB_BENCH_OUT``).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
from typing import Any, Callable, Sequence

import torch

OUT_DIR = os.environ.get("CPLIB_BENCH_OUT", os.path.join(os.path.dirname(__file__), "out"))


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"{cpu}, {os.cpu_count()} cores, {gpu}, torch {torch.__version__}"


def timeit(fn: Callable[[], Any], *, warmup: int = 2, iters: int = 5,
           sync: Callable[[], None] | None = None) -> float:
    """Median seconds of ``fn`` over ``iters`` runs after ``warmup`` runs.
    ``sync`` (a barrier, cuda synchronize) runs before each start and stop."""
    sync = sync or (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def fmt(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)
    cells = [[fmt(v) for v in r] for r in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"
    text = "\n".join([f"### {title}", "", line(columns),
                      "|" + "|".join("-" * (w + 2) for w in widths) + "|",
                      *(line(r) for r in cells)])
    print(text, flush=True)
    return text


def write_json(name: str, payload: dict[str, Any]) -> str:
    os.makedirs(OUT_DIR, exist_ok=True)
    path = os.path.join(OUT_DIR, f"{name}.json")
    payload = {"date": datetime.date.today().isoformat(), "machine": machine(), **payload}
    with open(path + ".tmp", "w") as f:  # replaced whole: a reader never sees half a file
        json.dump(payload, f, indent=2)
    os.replace(path + ".tmp", path)
    return path


def plot(name: str, title: str, xlabel: str, ylabel: str,
         series: dict[str, tuple[Sequence[float], Sequence[float]]],
         kind: str = "line") -> str:
    """Writes ``<name>.png``: one line (or bar group) per series of (xs, ys)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(OUT_DIR, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    if kind == "bar":
        labels = list(series)
        xs = [str(x) for x in series[labels[0]][0]]
        width = 0.8 / len(labels)
        for i, lab in enumerate(labels):
            ax.bar([j + i * width for j in range(len(xs))], series[lab][1], width, label=lab)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(xs))], xs)
    else:
        for lab, (xs, ys) in series.items():
            ax.plot(xs, ys, marker="o", label=lab)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = os.path.join(OUT_DIR, f"{name}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def interleaved(fns: dict[str, Callable[[], Any]], iters: int,
                sync: Callable[[], None] | None = None) -> dict[str, float]:
    """Median seconds of each fn, measured round-robin (one run of each per
    round, after one warm-up round) so that load changes on a shared machine
    hit every variant alike."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(iters + 1):
        for k, fn in fns.items():
            times[k].append(timeit(fn, warmup=0, iters=1, sync=sync))
    return {k: statistics.median(v[1:]) for k, v in times.items()}


def interleaved_wall_cpu(fns: dict[str, Callable[[], Any]], iters: int) -> dict[str, float]:
    """Median wall and CPU seconds (``<name>_cpu``) of each fn, one run of
    each per round, after one warm-up round; a barrier before and after each
    run, outside the CPU-time window (the ranks lined up: wall is the slowest
    rank's; CPU, this process's, is the work this rank did, free of the time
    it waited for a core on a loaded machine)."""
    import torch.distributed as dist

    wall: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(iters + 1):
        for k, fn in fns.items():
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            c1 = time.process_time()
            dist.barrier()
            wall[k].append(time.perf_counter() - t0)
            cpu[k].append(c1 - c0)
    out = {k: statistics.median(v[1:]) for k, v in wall.items()}
    out.update({f"{k}_cpu": statistics.median(v[1:]) for k, v in cpu.items()})
    return out


def cpu_seconds(fn: Callable[[], Any], iters: int) -> float:
    """Median CPU seconds of this process (all its threads) per call, the
    ranks lined up by a barrier before each: on a shared, oversubscribed
    machine this is the work a rank does, free of the time it waits for a core."""
    import torch.distributed as dist

    times = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return sorted(times)[len(times) // 2]


def time_full_sdpa(shape: Sequence[int], causal: bool, iters: int) -> tuple[float, float]:
    """The ideal: one process, full-sequence SDPA forward+backward on one
    thread, (B, H, S, D) = ``shape``. Returns (median wall s, median CPU s)."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*shape, generator=g).requires_grad_(True) for _ in range(3))

    def step():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        out.backward(torch.ones_like(out))
    wall = timeit(step, warmup=1, iters=iters)
    cpu = []
    for _ in range(iters):
        t0 = time.process_time()
        step()
        cpu.append(time.process_time() - t0)
    return wall, sorted(cpu)[len(cpu) // 2]


def peak_bytes(fn: Callable[[], Any]) -> int:
    """The most bytes the CPU allocator held at once during ``fn`` beyond
    what it held at the start (torch.profiler's memory events, in order)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def _rank_main(rank: int, n: int, port: int, timeout_s: float, fn, args, results) -> None:
    import traceback

    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        results.put((rank, True, fn(*args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def run_on_ranks(n: int, fn: Callable[..., Any], *args: Any,
                 timeout_s: float = 1800) -> list[Any]:
    """Runs module-level ``fn(*args)`` on ``n`` fresh gloo ranks over loopback
    (one intra-op thread each) and returns the per-rank results; exits with
    every failing rank's traceback."""
    import socket
    import sys

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, n, port, timeout_s, fn, args, results))
             for r in range(n)]
    for p in procs:
        p.start()
    got = [results.get() for _ in procs]
    for p in procs:
        p.join()
    errors = [f"rank {r} failed:\n{payload}" for r, ok, payload in sorted(got) if not ok]
    if errors:
        sys.exit("\n".join(errors))
    return [payload for _, _, payload in sorted(got, key=lambda t: t[0])]
