"""Packed documents: the document placement (cplib.DocumentPlacementLoadBalancer,
ring_sdpa(placement=True)) against per-document head-tail (p2p and
allgather) and the ideal, on CPU (gloo, one thread per rank).

Three document mixes at S = 16384, N = 4, causal, fwd+bwd, B=1 H=2 D=64 fp32:
the 8 documents of RESULTS.md's "Packed documents against the dense causal
ring"; 64 short documents (log-normal lengths, median 200, seeded); one
12288-token document plus short ones. Per layout: the slowest rank's median
wall time and the busiest rank's median CPU time (process time, every
thread: on a loaded machine the work a rank did, free of the time it waited
for a core; the variants of a mix run round-robin after a warm-up round, so
that the load of a shared machine hits each alike), each over the ideal (one
causal SDPA call per document in one process, one thread, / N; measured
before and after the ranks, the smaller kept) and over per-document
head-tail (p2p and allgather), the K/V and dK/dV MiB the busiest rank sends
in one fwd+bwd, and max / mean causal pairs per rank.

    python benchmarks/bench_placement.py
    CPLIB_BENCH_SERIES=placement python benchmarks/bench_ring_cpu.py     # the same
    CPLIB_BENCH_ITERS=5 CPLIB_BENCH_MIXES="8 docs" python benchmarks/bench_placement.py
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import interleaved_wall_cpu, machine, plot, print_table, run_on_ranks, write_json  # noqa: E402

S, N, B, H, D = 16384, 4, 1, 2, 64
ITERS = int(os.environ.get("CPLIB_BENCH_ITERS", "3"))
VARIANTS = {  # name: (layout, rotate)
    "placement p2p": ("placement", "p2p"),
    "per-document head-tail p2p": ("per_document", "p2p"),
    "per-document head-tail allgather": ("per_document", "allgather"),
}


def _lognormal(count: int, total: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    x = torch.exp(math.log(200) + 0.7 * torch.randn(count, generator=g, dtype=torch.float64))
    lengths = [max(1, round(v)) for v in (x / x.sum() * total).tolist()]
    lengths[-1] += total - sum(lengths)
    return lengths


def mixes() -> dict[str, list[int]]:
    """Document lengths of the three mixes (each sums to S)."""
    short = _lognormal(20, S - 12288, 1)
    return {"8 docs": [252, 5072, 573, 2091, 934, 6285, 1070, 107],
            "64 short": _lognormal(64, S, 0),
            "one long": short[:10] + [12288] + short[10:]}


def _bounds(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def positions(layout: str, cu: list[int], rank: int) -> torch.Tensor:
    if layout == "placement":
        import cplib
        pieces = cplib.DocumentPlacementLoadBalancer(cu, N, "cpu").pieces()[rank]
        return torch.cat([torch.arange(a, a + m) for a, m in pieces])
    from cplib.attention.layout import shard_positions
    return shard_positions(S, N, rank, True, documents=cu)


def causal_pairs(cu: list[int], pos: torch.Tensor) -> int:
    """Query-key pairs of these rows under the causal document mask."""
    doc = torch.bucketize(pos, torch.tensor(cu[1:]), right=True)
    return int((pos - torch.tensor(cu)[doc] + 1).sum())


def _rank_job(selected: list[str]) -> dict:
    import cplib
    from cplib.comm.native import ops

    rank = dist.get_rank()
    out = {}
    for name in selected:
        cu = _bounds(mixes()[name])
        fns, sent, pairs = {}, {}, {}
        for key, (layout, rotate) in VARIANTS.items():
            pos = positions(layout, cu, rank)
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(B, H, S, D, generator=g)[:, :, pos].contiguous()
                       .requires_grad_(True) for _ in range(3))
            extra = {"placement": True} if layout == "placement" else {"per_document": True}

            def step(q=q, k=k, v=v, rotate=rotate, extra=extra):
                o, _ = cplib.ring_sdpa(q, k, v, dist.group.WORLD, is_causal=True,
                                       load_balanced=True, rotate=rotate,
                                       cu_seqlens=torch.tensor(cu), seq_len=S, **extra)
                o.backward(torch.ones_like(o))
            dist.barrier()
            ops.ring_debug_bytes_sent(True)
            step()
            sent[key] = ops.ring_debug_bytes_sent(True)
            fns[key] = step
            pairs[key] = causal_pairs(cu, pos)
        t = interleaved_wall_cpu(fns, ITERS)
        out[name] = {k: (t[k], sent[k], pairs[k], t[f"{k}_cpu"]) for k in VARIANTS}
    return out


def _ideal(lengths: list[int]) -> tuple[float, float]:
    """One process, one thread: one causal SDPA per document, fwd+bwd; the
    median (wall, CPU) seconds / N."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, generator=g).requires_grad_(True) for _ in range(3))
    cu = _bounds(lengths)

    def step():
        outs = [F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b],
                                               is_causal=True) for a, b in zip(cu, cu[1:])]
        torch.cat(outs, 2).backward(torch.ones(B, H, S, D))
    step()
    wall, cpu = [], []
    for _ in range(ITERS):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall) / N, statistics.median(cpu) / N


def main() -> None:
    all_mixes = mixes()
    selected = [m.strip() for m in os.environ.get("CPLIB_BENCH_MIXES", ",".join(all_mixes))
                .split(",")]
    threads = torch.get_num_threads()
    ideal_before = {m: _ideal(all_mixes[m]) for m in selected}
    per_rank = run_on_ranks(N, _rank_job, selected)
    after = {m: _ideal(all_mixes[m]) for m in selected}
    ideal = {m: tuple(min(a, b) for a, b in zip(ideal_before[m], after[m])) for m in selected}
    torch.set_num_threads(threads)
    rows, data = [], []
    for m in selected:
        def slowest(key, i):
            return max(r[m][key][i] for r in per_rank)
        base, base_ag = (slowest(f"per-document head-tail {rot}", 0)
                         for rot in ("p2p", "allgather"))
        base_cpu, base_ag_cpu = (slowest(f"per-document head-tail {rot}", 3)
                                 for rot in ("p2p", "allgather"))
        base_sent = slowest("per-document head-tail p2p", 1)
        wall_ideal, cpu_ideal = ideal[m]
        for key in VARIANTS:
            t, sent, cpu = slowest(key, 0), slowest(key, 1), slowest(key, 3)
            pairs = [r[m][key][2] for r in per_rank]
            balance = max(pairs) / (sum(pairs) / N)
            rows.append((m, key, t, t / wall_ideal, t / base, t / base_ag, cpu, cpu / cpu_ideal,
                         cpu / base_cpu, cpu / base_ag_cpu, sent / 2 ** 20, sent / base_sent,
                         balance))
            data.append(dict(mix=m, variant=key, seconds=t, cpu_seconds=cpu,
                             ideal=wall_ideal, ideal_cpu=cpu_ideal, bytes_sent_max_rank=sent,
                             causal_pairs=pairs, ratio_ideal=t / wall_ideal, ratio_p2p=t / base,
                             ratio_allgather=t / base_ag, cpu_ratio_ideal=cpu / cpu_ideal,
                             cpu_ratio_p2p=cpu / base_cpu, cpu_ratio_allgather=cpu / base_ag_cpu))
    print_table(f"packed documents, causal fwd+bwd, N={N}, S={S}, B={B} H={H} D={D} fp32; "
                f"wall: the slowest rank; CPU: the busiest rank's process time; ideal: one "
                f"causal SDPA per document in one process, one thread, / N (wall/CPU s: "
                + ", ".join(f"{m} {ideal[m][0]:.3f}/{ideal[m][1]:.3f}" for m in selected) + ")",
                ["mix", "layout", "wall s", "wall/ideal", "wall vs per-doc p2p",
                 "wall vs per-doc allgather", "CPU s", "CPU/ideal", "CPU vs per-doc p2p",
                 "CPU vs per-doc allgather", "MiB sent (busiest)", "sent vs per-doc p2p",
                 "max/mean pairs"], rows)
    write_json("bench_placement", {"S": S, "N": N, "B": B, "H": H, "D": D, "iters": ITERS,
                                   "lengths": {m: all_mixes[m] for m in selected},
                                   "rows": data})
    plot("bench_placement", f"packed documents, CPU time / ideal (S={S}, N={N})", "mix",
         "CPU time / ideal", {key: (selected, [r["cpu_ratio_ideal"] for r in data
                                           if r["variant"] == key]) for key in VARIANTS},
         kind="bar")
    print(machine())


if __name__ == "__main__":
    main()
