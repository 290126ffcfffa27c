"""strategy="auto" against every candidate, on CPU (gloo, one thread per rank).

24 configurations: S in {2048, 8192, 16384}, N in {2, 4}, q heads {4, 16}
with K/V heads equal or a quarter, causal and not, dense, 8 packed documents
and a window of S/8 (B=1, D=32, fp32). For each: the calibration (measured
once per rank pool, timed), every candidate the model lists (the ring with
each rotation, Ulysses, USP), forward + backward, the slowest rank, median of
3 after a warm-up round, run round-robin; and the model's choice. Goals
(issue 37): auto / best <= 1.10 in >= 90 % of the configurations and <= 1.25
in all; per-configuration Spearman correlation of predicted and measured
times, median >= 0.8; auto / torch's prototype default (ring, allgather,
head-tail, run by cplib: torch's own ring has no documents or windows)
<= 1.0 everywhere; calibration <= 2 s.

Resumable: each finished configuration is a line of
``benchmarks/out/bench_strategy.jsonl``; a rerun skips those (delete the file,
or ``CPLIB_BENCH_FRESH=1``, to start over).

    python benchmarks/bench_strategy.py                      # the full sweep
    CPLIB_BENCH_QUICK=1 python benchmarks/bench_strategy.py  # 4 small configurations
    CPLIB_BENCH_ONLY=n2-s2048 python benchmarks/bench_strategy.py   # names containing it
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import OUT_DIR, machine, plot, print_table, run_on_ranks, write_json  # noqa: E402
from strategy_sweep import Config, run_configs  # noqa: E402

ITERS = int(os.environ.get("CPLIB_BENCH_ITERS", "3"))
DIM = int(os.environ.get("CPLIB_BENCH_DIM", "32"))
JSONL = os.path.join(OUT_DIR, "bench_strategy.jsonl")

# (S, q heads, K/V heads, causal, mask) per world size: every value of the
# issue's grid appears; the sizes keep the sweep near 10 minutes on 2 cores.
_GRID = [(2048, 4, 4, True, "dense"), (2048, 16, 4, False, "dense"),
         (2048, 16, 16, True, "documents"), (2048, 4, 1, False, "window"),
         (2048, 16, 4, True, "window"), (8192, 4, 1, True, "dense"),
         (8192, 4, 4, False, "documents"), (8192, 16, 4, True, "window"),
         (8192, 16, 16, True, "documents"), (16384, 4, 1, True, "window"),
         (16384, 4, 4, True, "documents"), (16384, 4, 1, False, "window")]


def configs() -> list[Config]:
    out = []
    for n in (2, 4):
        for s, hq, hkv, causal, mask in _GRID:
            name = f"n{n}-s{s}-h{hq}/{hkv}-{'causal' if causal else 'full'}-{mask}"
            out.append(Config(name, s, n, hq, hkv, causal, mask, DIM))
    if os.environ.get("CPLIB_BENCH_QUICK") == "1":
        out = [Config(c.name + "-quick", c.seq_len // 4, c.world_size, c.q_heads, c.kv_heads,
                      c.causal, c.mask, DIM) for c in out if c.seq_len == 2048][::3]
    only = os.environ.get("CPLIB_BENCH_ONLY")
    return [c for c in out if not only or only in c.name]


def _done() -> dict[str, dict]:
    if not os.path.exists(JSONL):
        return {}
    with open(JSONL) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {r["config"]["name"]: r for r in rows}


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Rank correlation (ties share their mean rank); None when either side
    is constant."""
    def ranks(vs: list[float]) -> list[float]:
        order = sorted(range(len(vs)), key=lambda i: vs[i])
        out = [0.0] * len(vs)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and vs[order[j + 1]] == vs[order[i]]:
                j += 1
            for t in range(i, j + 1):
                out[order[t]] = (i + j) / 2
            i = j + 1
        return out
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    sx = sum((a - mx) ** 2 for a in rx) ** 0.5
    sy = sum((b - my) ** 2 for b in ry) ** 0.5
    if sx == 0 or sy == 0:
        return None
    return sum((a - mx) * (b - my) for a, b in zip(rx, ry)) / (sx * sy)


def summarise(result: dict) -> dict:
    """One configuration's figures: auto's and the default's own times (each
    run through context_parallel, measured like every candidate), the best
    candidate's, and the rank correlation of predicted and measured times."""
    cands = result["candidates"]
    best = min(cands, key=lambda c: c["measured_s"])
    auto, default = result["auto"], result["default"]
    return dict(name=result["config"]["name"], chosen=result["auto_chose"], best=best["name"],
                auto_s=auto["measured_s"], best_s=best["measured_s"],
                default_s=default["measured_s"],
                auto_over_best=auto["measured_s"] / best["measured_s"],
                auto_over_default=auto["measured_s"] / default["measured_s"],
                spearman=spearman([c["predicted_s"] for c in cands],
                                  [c["measured_s"] for c in cands]),
                load=result.get("load"),
                calibration_s=result.get("calibration_s"), config_s=result.get("config_s"))


def goals(rows: list[dict], calibration: list[float]) -> list[tuple[str, str, str]]:
    ratios = [r["auto_over_best"] for r in rows]
    within = sum(x <= 1.10 for x in ratios) / len(ratios)
    corr = [r["spearman"] for r in rows if r["spearman"] is not None]
    vs_default = [r["auto_over_default"] for r in rows if r["auto_over_default"] is not None]
    out = [("auto/best <= 1.10 in >= 90 % of configs", f"{within:.0%}", _met(within >= 0.9)),
           ("auto/best <= 1.25 in all (worst)", f"{max(ratios):.3f}", _met(max(ratios) <= 1.25)),
           ("Spearman(predicted, measured) median >= 0.8",
            f"{statistics.median(corr):.2f}" if corr else "n/a",
            _met(bool(corr) and statistics.median(corr) >= 0.8)),
           ("auto/default <= 1.0 in every config (worst)",
            f"{max(vs_default):.3f}" if vs_default else "n/a",
            _met(bool(vs_default) and max(vs_default) <= 1.0))]
    if calibration:
        out.append(("calibration <= 2 s per process (worst)", f"{max(calibration):.2f} s",
                    _met(max(calibration) <= 2.0)))
    return out


def _met(ok: bool) -> str:
    return "yes" if ok else "NO"


def main() -> None:
    started = time.perf_counter()
    todo = configs()
    if os.environ.get("CPLIB_BENCH_FRESH") == "1" and os.path.exists(JSONL):
        os.remove(JSONL)
    done = _done()
    os.makedirs(OUT_DIR, exist_ok=True)
    for n in sorted({c.world_size for c in todo}):
        pending = [c for c in todo if c.world_size == n and c.name not in done]
        if pending:
            print(f"N={n}: {len(pending)} configurations", flush=True)
            run_on_ranks(n, run_configs, pending, ITERS, JSONL)
    done = _done()
    results = [done[c.name] for c in todo if c.name in done]
    rows = [summarise(r) for r in results]
    print_table(f"strategy='auto' against every candidate, fwd+bwd, slowest rank, median of "
                f"{ITERS} (B=1 D={DIM} fp32, gloo, 1 thread/rank)",
                ["config", "auto chose", "measured best", "auto s", "best s", "default s",
                 "auto/best", "auto/default", "spearman", "load"],
                [(r["name"], r["chosen"], r["best"], r["auto_s"], r["best_s"], r["default_s"],
                  r["auto_over_best"], r["auto_over_default"],
                  "-" if r["spearman"] is None else round(r["spearman"], 2),
                  "-" if not r["load"] else f"{r['load'][0]:.1f}-{r['load'][1]:.1f}")
                 for r in rows])
    calibration = [r["calibration_s"] for r in rows if r["calibration_s"] is not None]
    print_table("goals", ["goal", "measured", "met"], goals(rows, calibration))
    path = write_json("bench_strategy", {"iters": ITERS, "head_dim": DIM, "rows": rows,
                                         "results": results,
                                         "goals": goals(rows, calibration)})
    plot("bench_strategy", "auto's measured time / measured best and / torch default",
         "configuration", "ratio",
         {"auto / best": (list(range(len(rows))), [r["auto_over_best"] for r in rows]),
          "auto / default (ring allgather)": (list(range(len(rows))),
                                              [r["auto_over_default"] for r in rows])})
    print(f"json: {path}\nrows: {JSONL}\n{machine()}\n"
          f"bench_strategy: {time.perf_counter() - started:.0f} s this run "
          f"(configs: {sum(r['config_s'] or 0 for r in rows):.0f} s in all)")


if __name__ == "__main__":
    main()
