"""bench_ring_gpu.py's report: the rows of its JSON (written as cells
arrive), the tables, the speed goals, the results file of a CUDA run
(benchmarks/results/gpu.json: device, torch, commit, date, one row per ring
variant), and the count of cells that did not give a figure, which the GPU
check's verdict reads."""

from __future__ import annotations

import math
import os

import ring_split_report as split_report

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DEFAULT = os.path.join(HERE, "results", "gpu.json")


def ms(x: float | str) -> str:
    return f"{x * 1e3:.2f}" if isinstance(x, float) else x


def best(cells: dict[str, float | str]) -> tuple[str, float] | tuple[None, None]:
    ok = {k: v for k, v in cells.items() if isinstance(v, float)}
    if not ok:
        return None, None
    key = min(ok, key=ok.get)
    return key, ok[key]


def commit() -> str:
    """The measured commit: $CPLIB_COMMIT (the GPU check sets it from the
    prepared wheel's folder, whose commit the wheel was built from), else
    git's HEAD (with "-dirty" for uncommitted changes), else "unknown" with
    the reason."""
    import subprocess
    if os.environ.get("CPLIB_COMMIT"):
        return os.environ["CPLIB_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True,
                              text=True, check=True, timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=HERE, capture_output=True, text=True, timeout=30).stdout
        return head + ("-dirty" if dirty.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown (no .git and no CPLIB_COMMIT)"


def results_rows(payload_rows: list[dict]) -> list[dict]:
    """One row per measured cplib variant (backend/rotation): its time, the
    fastest full SDPA call's and torch's ring's (best of its variants), and
    the ratios. Cells that errored are left out (the log has them)."""
    rows = []
    for r in payload_rows:
        full = min((v for v in r["full_ms"].values() if isinstance(v, float)), default=None)
        theirs = min((v for v in r["torch_ms"].values() if isinstance(v, float)), default=None)
        for key, ms in r["cplib_ms"].items():
            if not isinstance(ms, float):
                continue
            backend, rotate = key.split("/")
            rows.append(dict(S=r["s"], N=r["n"], causal=r["causal"], hq=r["hq"], hkv=r["hkv"],
                             backend=backend, rotate=rotate, full_ms=full, cplib_ms=ms,
                             torch_ms=theirs, ratio_full=ms / full if full else None,
                             ratio_torch=ms / theirs if theirs else None))
    return rows


def write_results(path: str, payload_rows: list[dict], dev) -> str:
    """Writes the results file of a CUDA run (never called without a GPU:
    the figures are this run's, or there is no file). torch is imported here
    only: the GPU check reads the verdict without it."""
    import datetime
    import json

    import torch
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    payload = dict(device=torch.cuda.get_device_name(dev), torch=torch.__version__,
                   commit=commit(),
                   date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                   rows=results_rows(payload_rows))
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    return path


def goals(rows: list[dict], merge: list[dict]) -> list[tuple[str, str, str]]:
    def find(s, n, causal, hq_eq_hkv=True):
        return next((r for r in rows if r["s"] == s and r["n"] == n and r["causal"] == causal
                     and (r["hq"] == r["hkv"]) == hq_eq_hkv), None)

    def verdict(value, limit, below=True):
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "-", "not measured"
        return f"{value:.2f}", "yes" if (value <= limit if below else value >= limit) else "NO"

    out = []
    merge = [m for m in merge if isinstance(m, dict)]
    r = find(32768, 4, True)
    out.append(("cplib/full <= 1.10 at S=32768 N=4 causal",
                *verdict(r and r["cplib_over_full"], 1.10)))
    for r in (x for x in rows if x["s"] == 65536 and x["hq"] == x["hkv"]):
        out.append((f"cplib/full <= 1.05 at S=65536 N={r['n']} "
                    f"{'causal' if r['causal'] else 'non-causal'}",
                    *verdict(r["cplib_over_full"], 1.05)))
    # Issue 54's goals (the earlier ones of issues 12 and 18 above and below).
    worst = [x["cplib_over_torch"] for x in rows if x["s"] >= 32768 and x["cplib_over_torch"]]
    out.append(("cplib/torch <= 0.85 at every S >= 32768 (worst)",
                *verdict(max(worst) if worst else None, 0.85)))
    r = find(8192, 4, True)
    out.append(("cplib/full <= 2.0 at S=8192 N=4 causal",
                *verdict(r and r["cplib_over_full"], 2.0)))
    out += split_report.goals(rows)
    if merge:
        out.append(("merge >= 0.85 of copy bandwidth (worst)",
                    *verdict(min(m["ratio"] for m in merge), 0.85, below=False)))
        combined = [m["combine_ratio"] for m in merge if "combine_ratio" in m]
        if combined:
            out.append(("combine (4 parts) >= 0.85 of copy bandwidth (worst)",
                        *verdict(min(combined), 0.85, below=False)))
    slower = []
    for x in rows:
        for b in ("flash", "efficient", "cudnn"):
            p2p, ag = x["cplib_ms"].get(f"{b}/p2p"), x["cplib_ms"].get(f"{b}/allgather")
            if isinstance(p2p, float) and isinstance(ag, float):
                slower.append(p2p / ag)
    out.append(("p2p no slower than allgather (worst p2p/allgather)",
                *verdict(max(slower) if slower else None, 1.0)))
    g = find(32768, 4, True, hq_eq_hkv=False)
    mha = find(32768, 4, True)
    if g and mha and g["best_cplib"] and mha["best_cplib"]:
        ratio = g["cplib_ms"][g["best_cplib"]] / mha["cplib_ms"][mha["best_cplib"]]
        out.append(("GQA 16/4 faster than MHA (cplib best, GQA/MHA)", *verdict(ratio, 1.0)))
    return out


def payload_rows(configs: list, results: dict) -> list[dict]:
    """One JSON row per configuration measured so far (cells in ms; errors,
    time-outs and skips as their strings)."""
    rows = []
    for cfg in configs:
        r = results.get(cfg)
        if r is None:
            continue
        fb, ft = best(r["full"])
        explicit = {k: v for k, v in r["cplib"].items() if not k.startswith("auto/")}
        cb, ct = best(explicit)
        tb, tt = best(r["torch"])
        rows.append(dict(
            s=cfg.s, n=cfg.n, causal=cfg.causal, hq=cfg.hq, hkv=cfg.hkv,
            full_ms={k: (v * 1e3 if isinstance(v, float) else v) for k, v in r["full"].items()},
            cplib_ms={k: (v * 1e3 if isinstance(v, float) else v) for k, v in r["cplib"].items()},
            torch_ms={k: (v * 1e3 if isinstance(v, float) else v) for k, v in r["torch"].items()},
            best_full=fb, best_cplib=cb, best_torch=tb,
            cplib_over_full=ct / ft if ct and ft else None,
            cplib_over_torch=ct / tt if ct and tt else None,
            **split_report.row_fields(cfg.n, r, ft * 1e3 if ft else None)))
    return rows


def problem_cells(payload: dict) -> dict[str, list[str]]:
    """The cells without a figure, by kind: "cplib" (cplib's errors, NaN,
    time-outs; a merge cell with a figure that is not finite), "baseline"
    (full SDPA's and torch's), "skipped" (not started in the time budget),
    "profile" (a profiled variant without its split, a T_blocks without its
    figure). Empty lists: every cell gave a figure."""
    out: dict[str, list[str]] = {"cplib": [], "baseline": [], "skipped": [], "profile": []}
    for r in payload.get("rows", []):
        tag = f"S={r['s']} N={r['n']} {'causal' if r['causal'] else 'non-causal'} " \
              f"{r['hq']}/{r['hkv']}"
        for impl in ("full", "torch", "cplib"):
            for key, val in r[f"{impl}_ms"].items():
                if isinstance(val, (int, float)) and math.isfinite(val):
                    continue
                kind = "skipped" if str(val).startswith("skipped") else \
                    ("cplib" if impl == "cplib" else "baseline")
                out[kind].append(f"{tag} {impl} {key}: {val}")
        out["profile"] += [f"{tag} T_blocks {b}: {v}" for b, v in r.get("blocks", {}).items()
                           if not isinstance(v, dict)]
    out["profile"] += split_report.problems(payload)
    for m in payload.get("merge", []):
        if isinstance(m, str):
            out["skipped" if m.startswith("skipped") else "cplib"].append(f"merge: {m}")
            continue
        bad = sorted(k for k, v in m.items() if isinstance(v, float) and not math.isfinite(v))
        if bad:  # a figure of NaN or inf (a timing that went wrong) is no figure
            out["cplib"].append(f"merge {m.get('shape', '?')}: {', '.join(bad)} not finite")
    return out


def print_tables(rows: list[dict], merge: list[dict], goal_rows, st, heads: int,
                 dev_type: str) -> None:
    from common import print_table

    summary, detail = [], []
    for r in rows:
        full = {k: v / 1e3 if isinstance(v, float) else v for k, v in r["full_ms"].items()}
        cpl = {k: v / 1e3 if isinstance(v, float) else v for k, v in r["cplib_ms"].items()}
        tor = {k: v / 1e3 if isinstance(v, float) else v for k, v in r["torch_ms"].items()}
        fb, ft = best(full)
        cb, ct = best({k: v for k, v in cpl.items() if not k.startswith("auto/")})
        tb, tt = best(tor)
        label = f"S={r['s']} N={r['n']} {'causal' if r['causal'] else 'non-causal'}" + \
            (f" GQA {r['hq']}/{r['hkv']}" if r["hq"] != r["hkv"] else "")
        summary.append((r["s"], r["n"], "yes" if r["causal"] else "no",
                        "MHA" if r["hq"] == r["hkv"] else f"GQA {r['hq']}/{r['hkv']}",
                        f"{ms(ft)} ({fb})" if ft else "-", f"{ms(ct)} ({cb})" if ct else "-",
                        f"{ct / ft:.2f}" if ct and ft else "-", ms(cpl.get("auto/p2p", "-")),
                        f"{ms(tt)} ({tb})" if tt else next(iter(tor.values()), "-"),
                        f"{ct / tt:.2f}" if ct and tt else "-"))
        for impl, cells in (("full", full), ("cplib", cpl), ("torch", tor)):
            for key, val in cells.items():
                detail.append((label, impl, key, ms(val),
                               f"{val / ft:.2f}" if isinstance(val, float) and ft else "-"))
    print_table("detail: every variant (ms; / full = against the fastest full SDPA call)",
                ["config", "impl", "backend/rotation", "ms", "/ full"], detail)
    ok_merge = [m for m in merge if isinstance(m, dict)]
    print_table("merge kernel against a device-to-device copy of the same bytes; the "
                "combine of 4 partial outputs (the ring's forward) against a copy of its bytes",
                ["shape", "block dtype", "MiB", "merge GB/s", "copy GB/s", "merge/copy",
                 "combine GB/s", "combine/copy"],
                [(m["shape"], m["block_dtype"], m["bytes"] / 2**20, m["merge_gbps"],
                  m["copy_gbps"], m["ratio"], m.get("combine_gbps", "-"),
                  m.get("combine_ratio", "-")) for m in ok_merge])
    print_table("where the time goes: one profiled fwd+bwd step of every rank (shares of its "
                "wall time), the ring's kernels and T_blocks against one full call, the "
                "projection to N GPUs", split_report.TABLE_COLUMNS, split_report.table_rows(rows))
    print_table("goals", ["goal", "measured", "met"], goal_rows)
    print_table(f"ring attention fwd+bwd, N ranks sharing one {dev_type} device "
                f"(B={st.b} H={heads} D={st.d} {str(st.dtype).split('.')[-1]})",
                ["S", "N", "causal", "heads", "full SDPA ms (best)", "cplib ms (best)",
                 "cplib / full", "cplib auto p2p ms", "torch CP ms (best)", "cplib / torch"],
                summary)


def plot_series(rows: list[dict]) -> dict:
    series = {}
    for (n, causal) in sorted({(c["n"], c["causal"]) for c in rows}):
        mine = sorted((c for c in rows if c["n"] == n and c["causal"] == causal
                       and c["hq"] == c["hkv"]), key=lambda c: c["s"])
        tag = f"N={n} {'causal' if causal else 'non-causal'}"
        for key, name in (("cplib_over_full", "cplib/full"), ("cplib_over_torch", "cplib/torch")):
            pts = [(c["s"], c[key]) for c in mine if c[key]]
            if pts:
                series[f"{name} {tag}"] = tuple(map(list, zip(*pts)))
    return series


def verdict(path: str) -> list[str]:
    """The bench stage's verdict from bench_ring_gpu.json: "PASS: ..." when the
    run completed and every cell gave a finite figure; "FAIL: ..." when a
    cplib cell errored, gave NaN or timed out; "INCOMPLETE: ..." when only
    baseline cells failed, cells were skipped, the run was cut short or left
    no JSON. (The GPU check adds the benchmark's exit status: run.sh.) Then
    one line per cell without a figure."""
    import json

    try:
        with open(path) as f:
            payload = json.load(f)
    except (OSError, ValueError) as exc:  # the stage's exit status says whether it failed
        return [f"INCOMPLETE: no benchmark JSON ({type(exc).__name__})"]
    problems = problem_cells(payload)
    met = [g for g in payload.get("goals", []) if g.get("met") == "yes"]
    head = (f"{payload.get('cells_done', 0)} of {payload.get('cells', '?')} cells; "
            f"{len(problems['cplib'])} cplib cells and {len(problems['baseline'])} baseline "
            f"cells without a figure, {len(problems['skipped'])} skipped, "
            f"{len(problems['profile'])} splits or T_blocks missing; goals met "
            f"{len(met)} of {len(payload.get('goals', []))}")
    if problems["cplib"]:
        kind = "FAIL"
    elif problems["baseline"] or problems["skipped"] or problems["profile"] \
            or not payload.get("complete"):
        kind = "INCOMPLETE"
        if not payload.get("complete"):
            head += "; the run was cut short"
    else:
        kind = "PASS"
    return [f"{kind}: {head}"] + [f"{k}: {c}" for k, items in problems.items() for c in items]


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["verdict"] and len(sys.argv) == 3:
        print("\n".join(verdict(sys.argv[2])))
    else:
        sys.exit("usage: ring_report.py verdict BENCH_JSON")
