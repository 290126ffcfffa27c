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
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
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
