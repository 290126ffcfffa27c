"""bench_ring_gpu.py's report of where the time goes: each row's profiled
splits (ring_profile.py), T_blocks (ring_blocks.py), the projection to N
GPUs, the table of them, the goals they judge, and the PNG (ratios against
S beside the splits as stacked bars). No torch here: the GPU check reads
the benchmark's verdict without it."""

from __future__ import annotations

import os

# NVLink 4 (H100/H200 SXM) carries 450 GB/s per direction; NCCL's send/recv
# between two GPUs through NVSwitch reaches about 90% of it.
LINK_GBPS = 400.0
PARTS = ("attention", "other", "comm", "idle")


def shown(cell: dict, value) -> str:
    """A cell's value as the log shows it."""
    if isinstance(value, float):
        return f"{value * 1e3:.2f} ms"
    if isinstance(value, dict) and "merge_gbps" in value:
        return f"{value['merge_gbps']:.1f} GB/s"
    if isinstance(value, dict) and "seconds" in value:
        p = value.get("profile") or {}
        split = (", ".join(f"{k} {p[k + '_s'] * 1e3:.2f}" for k in PARTS)
                 if "wall_s" in p else p.get("error", "no split"))
        return f"{value['seconds'] * 1e3:.2f} ms (profiled step, ms: {split})"
    if isinstance(value, dict):  # T_blocks per backend
        return ", ".join(f"{b} {v['total_s'] * 1e3:.2f} ms" if isinstance(v, dict) else f"{b} {v}"
                         for b, v in value.items())
    return str(value)


def projection(profile, full_ms: float | None, n: int, link_gbps: float = LINK_GBPS):
    """The ring on N GPUs from one profiled step: per rank its kernel time
    (attention + other; the threaded group's copies are the link's work on N
    GPUs) and its bytes over ``link_gbps``; ``overlap_ms`` = the slowest
    rank's max of the two (every exchange hidden), ``serial_ms`` = its sum
    (none hidden); ``ideal_ms`` = one full call's time over N."""
    if not isinstance(profile, dict) or "per_rank" not in profile \
            or not profile.get("sent_bytes"):
        return None
    compute = [r["attention_s"] + r["other_s"] for r in profile["per_rank"]]
    link = [b / (link_gbps * 1e9) for b in profile["sent_bytes"]]
    overlap = max(max(c, w) for c, w in zip(compute, link)) * 1e3
    serial = max(c + w for c, w in zip(compute, link)) * 1e3
    ideal = full_ms / n if full_ms else None
    return dict(link_gbps=link_gbps, compute_ms=[c * 1e3 for c in compute],
                link_ms=[w * 1e3 for w in link], overlap_ms=overlap, serial_ms=serial,
                ideal_ms=ideal, overlap_over_ideal=overlap / ideal if ideal else None,
                serial_over_ideal=serial / ideal if ideal else None)


def row_fields(n: int, r: dict, full_ms: float | None) -> dict:
    """The JSON row's fields of this report: the splits by variant
    ("cplib/cudnn/p2p", ...), T_blocks by backend, the projections."""
    profiles = r.get("profile", {})
    return dict(profile=profiles, blocks=r.get("blocks", {}),
                projection={k: projection(p, full_ms, n) for k, p in profiles.items()})


def best_profiled(row: dict, impl: str) -> str | None:
    """The fastest variant of ``impl`` ("cplib", "torch") that has a split."""
    timed = row[f"{impl}_ms"]
    keys = [k.split("/", 1)[1] for k, p in row.get("profile", {}).items()
            if k.startswith(impl + "/") and isinstance(p, dict) and "wall_s" in p]
    keys = [k for k in keys if isinstance(timed.get(k), float)]
    return min(keys, key=timed.get) if keys else None


def _kernel_ms(p: dict) -> float:
    return (p["attention_s"] + p["other_s"]) * 1e3


def _blocks_ms(row: dict) -> float | None:
    ok = [v["total_s"] * 1e3 for v in row.get("blocks", {}).values() if isinstance(v, dict)]
    return min(ok) if ok else None


def table_rows(rows: list[dict]) -> list[tuple]:
    """Per configuration: cplib's fastest profiled variant, cplib's default
    call and torch's fastest profiled variant, each with its split (share of
    the profiled step's wall time), its kernel time against one full call,
    T_blocks against it, and the projection to N GPUs against full / N."""
    out = []
    for row in rows:
        full = min((v for v in row["full_ms"].values() if isinstance(v, float)), default=None)
        label = (f"S={row['s']} N={row['n']} {'causal' if row['causal'] else 'non-causal'}"
                 + (f" GQA {row['hq']}/{row['hkv']}" if row["hq"] != row["hkv"] else ""))
        blocks = _blocks_ms(row)
        variants = [("cplib", best_profiled(row, "cplib")), ("cplib", "auto/p2p"),
                    ("torch", best_profiled(row, "torch"))]
        seen = set()
        for impl, key in variants:
            name = f"{impl}/{key}"
            p = row.get("profile", {}).get(name)
            if key is None or name in seen or not isinstance(p, dict):
                continue
            seen.add(name)
            if "wall_s" not in p:
                out.append((label, name, p.get("error", "-")) + ("-",) * 8)
                continue
            wall = p["wall_s"]
            share = [f"{p[part + '_s'] / wall:.0%}" if wall else "-" for part in PARTS]
            proj = row.get("projection", {}).get(name)
            proj_txt = (f"{proj['overlap_ms']:.2f}-{proj['serial_ms']:.2f}"
                        + (f" ({proj['overlap_over_ideal']:.2f}-{proj['serial_over_ideal']:.2f})"
                           if proj["ideal_ms"] else "")) if proj else "-"
            out.append((label, name, f"{wall * 1e3:.2f}", *share,
                        f"{_kernel_ms(p) / full:.2f}" if full else "-",
                        f"{blocks / full:.2f}" if blocks and full else "-", proj_txt))
    return out


TABLE_COLUMNS = ["config", "variant", "profiled step ms", "attention", "other", "comm", "idle",
                 "kernels / full", "T_blocks / full",
                 f"N GPUs ms, overlapped-serial (/ ideal), {LINK_GBPS:.0f} GB/s"]


def goals(rows: list[dict]) -> list[tuple[str, str, str]]:
    """Issue 54's goal on kernel time: the ring's kernels (all ranks,
    attention + other) over one full call, at S=32768 and 65536, N=4,
    causal, cplib's fastest profiled variant."""
    out = []
    for s in (32768, 65536):
        row = next((r for r in rows if r["s"] == s and r["n"] == 4 and r["causal"]
                    and r["hq"] == r["hkv"]), None)
        value = None
        if row is not None:
            full = min((v for v in row["full_ms"].values() if isinstance(v, float)), default=None)
            key = best_profiled(row, "cplib")
            if key and full:
                value = _kernel_ms(row["profile"][f"cplib/{key}"]) / full
        goal = f"ring kernel time (all ranks) / full <= 1.05 at S={s} N=4 causal"
        out.append((goal, "-", "not measured") if value is None else
                   (goal, f"{value:.2f}", "yes" if value <= 1.05 else "NO"))
    return out


def problems(payload: dict) -> list[str]:
    """The profiled variants without a split (a profiler or parse error)."""
    out = []
    for r in payload.get("rows", []):
        for k, p in r.get("profile", {}).items():
            if not (isinstance(p, dict) and "wall_s" in p):
                out.append(f"S={r['s']} N={r['n']} {k}: "
                           f"{p.get('error') if isinstance(p, dict) else p}")
    return out


def plot_png(path: str, ratio_series: dict, rows: list[dict], title: str) -> str:
    """One PNG: the time ratios against S (left) and, per configuration,
    the profiled step's split of cplib's and torch's fastest variants (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 4.5))
    for lab, (xs, ys) in ratio_series.items():
        left.plot(xs, ys, marker="o", label=lab)
    left.set_title(title)
    left.set_xlabel("S")
    left.set_ylabel("time ratio (1.0 = baseline)")
    left.grid(alpha=0.3)
    if ratio_series:
        left.legend(fontsize=7)
    bars = []
    for row in rows:
        tag = f"S{row['s'] // 1024}k N{row['n']}{'' if row['causal'] else ' nc'}" + \
            ("" if row["hq"] == row["hkv"] else " gqa")
        for impl in ("cplib", "torch"):
            key = best_profiled(row, impl)
            if key:
                bars.append((f"{tag}\n{impl}", row["profile"][f"{impl}/{key}"]))
    bottom = [0.0] * len(bars)
    for part in PARTS:
        vals = [p[part + "_s"] * 1e3 for _, p in bars]
        right.bar(range(len(bars)), vals, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    right.set_xticks(range(len(bars)), [b[0] for b in bars], fontsize=6)
    right.set_ylabel("ms of the profiled step")
    right.set_title("where the time goes (fastest profiled variant)")
    right.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
