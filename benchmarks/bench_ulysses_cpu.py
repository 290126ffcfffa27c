"""Ring, Ulysses and USP side by side on CPU (gloo, one thread per rank),
causal attention forward + backward per rank, at N = 2 and 4:

* time per rank (wall, and CPU seconds, which on an oversubscribed machine
  is the work a rank does) over the ideal: the single-process, one-thread
  full-sequence SDPA forward + backward divided by N, measured in this run;
* bytes each rank sent in one forward + backward, measured by the ops'
  counters (ring_debug_bytes_sent + ulysses_debug_bytes_sent), next to the
  formula;
* peak memory per rank beyond the inputs (a fresh process per variant).

torch has no Ulysses or USP to compare with; its ring is in bench_ring_cpu.py.

    python benchmarks/bench_ulysses_cpu.py                 # B=1 H=8 S=4096 D=64 fp32
    CPLIB_BENCH_SEQ=2048 python benchmarks/bench_ulysses_cpu.py
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from common import (cpu_seconds, machine, plot, print_table, run_on_ranks, time_full_sdpa, timeit,  # noqa: E402
                    write_json)

B, H, D = 1, 8, 64
S = int(os.environ.get("CPLIB_BENCH_SEQ", "4096"))
ITERS = int(os.environ.get("CPLIB_BENCH_ITERS", "3"))
WORLDS = [int(x) for x in os.environ.get("CPLIB_BENCH_WORLDS", "2,4").split(",")]
ELEM = 4  # fp32


def _variants(n: int) -> list[tuple[str, int]]:
    """(name, ulysses_degree): the ring (U=1), Ulysses (U=N), and USP in between."""
    out = [("ring", 1), ("ulysses", n)]
    out += [(f"usp U={u}", u) for u in range(2, n) if n % u == 0]
    return out


def _local_inputs(u: int):
    """This rank's q, k, v in the layout of the variant (cplib/ulysses/usp_layout.py): head-tail
    over the ring degree N/U, then cut into N pieces."""
    from cplib.ring.load_balancer import head_tail_indices

    rank, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    perm = head_tail_indices(S, n // u)
    return [torch.randn(B, H, S, D, generator=g)[:, :, perm].chunk(n, dim=2)[rank]
            .contiguous().requires_grad_(True) for _ in range(3)]


def _step_fn(u: int):
    import cplib
    from cplib.ulysses.usp_layout import usp_groups

    groups = usp_groups(dist.group.WORLD, u)  # collective once, before timing

    def step(q, k, v):
        if groups.ulysses_group is None:
            out, _ = cplib.ring_sdpa(q, k, v, groups.ring_group, is_causal=True,
                                     load_balanced=True)
        elif groups.ring_group is None:
            out, _ = cplib.ulysses_sdpa(q, k, v, groups.ulysses_group, is_causal=True)
        else:
            out, _ = cplib.usp_sdpa(q, k, v, groups.ulysses_group, groups.ring_group,
                                    is_causal=True, load_balanced=True)
        out.backward(torch.ones_like(out))
    return step


def _bytes_sent(reset: bool) -> int:
    from cplib.comm.native import ops
    return ops.ring_debug_bytes_sent(reset) + ops.ulysses_debug_bytes_sent(reset)


def _time_rank(u: int):
    q, k, v = _local_inputs(u)
    step = _step_fn(u)
    run = lambda: step(q, k, v)  # noqa: E731
    wall = timeit(run, warmup=1, iters=ITERS, sync=dist.barrier)
    cpu = cpu_seconds(run, ITERS)
    dist.barrier()
    _bytes_sent(True)
    run()
    sent = _bytes_sent(True)
    return wall, cpu, sent


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(field)


def _peak_memory(u: int) -> float:
    q, k, v = _local_inputs(u)
    step = _step_fn(u)
    step(q, k, v)  # warm-up: lazy library state is not the variant's
    q.grad = k.grad = v.grad = None
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak (VmHWM) to the current RSS
    base = _rss_kib("VmRSS")
    step(q, k, v)
    dist.barrier()
    return (_rss_kib("VmHWM") - base) / 1024.0


def _jobs(jobs):
    return [fn(*args) for fn, args in jobs]


def _formula_bytes(name: str, n: int, u: int) -> float:
    """Per-rank bytes of one causal fwd+bwd by the formulas of the README
    (lse ignored): shard = one of q/k/v/out on one rank."""
    shard = B * H * (S // n) * D * ELEM
    r = n // u
    # Ulysses: fwd q, k, v, out; bwd grad_out, dq, dk, dv: 8 shards x (U-1)/U
    ulysses = 8 * shard * (u - 1) / u if u > 1 else 0.0
    # ring (p2p): fwd K/V blocks N-1 steps, bwd K/V N-1 steps + dK/dV N steps;
    # after the Ulysses exchange a ring block is U shards' rows of H/U heads = 1 shard.
    ring = 2 * shard * ((r - 1) + (r - 1) + r) if r > 1 else 0.0
    return ulysses + ring


def _single_full():
    return time_full_sdpa((B, H, S, D), True, ITERS)


def main() -> None:
    threads = torch.get_num_threads()
    single_wall, single_cpu = _single_full()
    torch.set_num_threads(threads)
    rows, payload = [], {"B": B, "H": H, "S": S, "D": D, "dtype": "float32", "causal": True,
                         "rows": []}
    for n in WORLDS:
        variants = _variants(n)
        per_rank = run_on_ranks(n, _jobs, [(_time_rank, (u,)) for _, u in variants])
        saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # RSS tracks live memory
        try:
            peaks = [max(run_on_ranks(n, _jobs, [(_peak_memory, (u,))]))[0]
                     for _, u in variants]
        finally:
            if saved is None:
                os.environ.pop("MALLOC_MMAP_THRESHOLD_")
            else:
                os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
        for j, (name, u) in enumerate(variants):
            wall = max(r[j][0] for r in per_rank)
            cpu = max(r[j][1] for r in per_rank)
            sent = max(r[j][2] for r in per_rank)
            ideal_wall, ideal_cpu = single_wall / n, single_cpu / n
            formula = _formula_bytes(name, n, u)
            rows.append((n, name, n // u, u, wall, wall / ideal_wall, cpu, cpu / ideal_cpu,
                         sent / 2**20, formula / 2**20, peaks[j]))
            payload["rows"].append(dict(n=n, variant=name, ring_degree=n // u, ulysses_degree=u,
                                        wall_s=wall, wall_ratio=wall / ideal_wall, cpu_s=cpu,
                                        cpu_ratio=cpu / ideal_cpu, bytes_sent=sent,
                                        bytes_formula=formula, peak_mib=peaks[j]))
    print_table(f"causal fwd+bwd per rank, B={B} H={H} S={S} D={D} fp32, 1 thread/rank "
                f"(single-process full: wall {single_wall:.3f}s, cpu {single_cpu:.3f}s)",
                ["N", "variant", "R", "U", "wall s", "wall/ideal", "cpu s", "cpu/ideal",
                 "MiB sent", "MiB formula", "peak MiB"], rows)
    payload["single_full"] = {"wall_s": single_wall, "cpu_s": single_cpu}
    write_json("bench_ulysses_cpu", payload)
    labels = [f"N={r['n']}" for r in payload["rows"] if r["variant"] == "ring"]
    series = {}
    for name in ("ring", "usp U=2", "ulysses"):
        pts = [(f"N={r['n']}", r["cpu_ratio"]) for r in payload["rows"] if r["variant"] == name]
        if len(pts) == len(labels):
            series[name] = (labels, [p[1] for p in pts])
        elif pts:  # USP exists at N=4 only: pad the others with 0
            have = dict(pts)
            series[name] = (labels, [have.get(lab, 0.0) for lab in labels])
    plot("bench_ulysses_cpu", f"causal fwd+bwd CPU time / ideal (S={S}, H={H})", "world size",
         "cpu time / (full / N)", series, kind="bar")
    print(machine())


if __name__ == "__main__":
    main()
