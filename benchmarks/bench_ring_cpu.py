"""Ring attention on CPU (gloo, one thread per rank): cplib.ring_sdpa forward +
backward per rank against the ideal (single-process, one-thread full-sequence
SDPA forward + backward divided by N, measured in the same run), the three
rotations side by side, torch's own ring (its _templated_ring_attention driven
with the CPU flash kernel) where it runs, and peak memory per rank beyond the
inputs for the three rotations at N = 4.

    python benchmarks/bench_ring_cpu.py            # B=1, H=8, S=8192, D=64, fp32
    CPLIB_BENCH_SEQ=2048 python benchmarks/bench_ring_cpu.py   # quicker
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import machine, plot, print_table, run_on_ranks, timeit, write_json  # noqa: E402

B, H, D = 1, 8, 64
S = int(os.environ.get("CPLIB_BENCH_SEQ", "8192"))
ITERS = int(os.environ.get("CPLIB_BENCH_ITERS", "3"))
ROTATIONS = ["p2p", "alltoall", "allgather"]
WORLDS = [int(x) for x in os.environ.get("CPLIB_BENCH_WORLDS", "2,4").split(",")]
WITH_TORCH = os.environ.get("CPLIB_BENCH_TORCH", "1") == "1"


def _shard(t, rank, n, lb):
    if not lb:
        return t.chunk(n, dim=2)[rank]
    c = t.chunk(2 * n, dim=2)
    return torch.cat([c[rank], c[2 * n - 1 - rank]], dim=2)


def _inputs(rank, n, lb):
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(B, H, S, D, generator=g) for _ in range(3)]
    return [_shard(t, rank, n, lb).contiguous().requires_grad_(True) for t in full]


def _cplib_step(q, k, v, causal, lb, rotate):
    import cplib
    out, _ = cplib.ring_sdpa(q, k, v, dist.group.WORLD, is_causal=causal, load_balanced=lb,
                             rotate=rotate)
    out.backward(torch.ones_like(out))


def _torch_step(q, k, v, causal, lb, rotate):
    # torch's ring driven with the CPU kernel (its context_parallel only maps
    # the CUDA SDPA kernels, so this is the nearest runnable equivalent).
    from torch.distributed.tensor.experimental._context_parallel import _attention as A
    A._cp_options.enable_load_balance = lb
    A._cp_options.rotate_method = {"alltoall": A._RotateMethod.ALL_TO_ALL,
                                   "allgather": A._RotateMethod.ALL_GATHER}[rotate]
    aten = torch.ops.aten
    with torch.no_grad():
        out, lse, *_ = A._templated_ring_attention(
            dist.group.WORLD, 2, aten._scaled_dot_product_flash_attention_for_cpu, q, k, v,
            is_causal=causal)
        A._templated_ring_attention_backward(
            dist.group.WORLD, 2, aten._scaled_dot_product_flash_attention_for_cpu_backward,
            torch.ones_like(out), "grad_out", q, k, v, out, lse, causal, dropout_p=0.0)


def _cpu_seconds(fn, iters):
    """Median CPU seconds of this process (all its threads) per call: on a
    shared, oversubscribed machine this is the work a rank does, free of the
    time it waits for a core."""
    times = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return sorted(times)[len(times) // 2]


def _time_rank(impl, causal, lb, rotate):
    rank, n = dist.get_rank(), dist.get_world_size()
    q, k, v = _inputs(rank, n, lb)
    step = _cplib_step if impl == "cplib" else _torch_step
    try:
        t = timeit(lambda: step(q, k, v, causal, lb, rotate), warmup=1, iters=ITERS,
                   sync=dist.barrier)
        cpu = _cpu_seconds(lambda: step(q, k, v, causal, lb, rotate), ITERS)
    except Exception as exc:  # torch's ring may not run: report why
        return f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    return t, cpu


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(field)


def _peak_memory(rotate):
    """Peak RSS of one fwd+bwd beyond the inputs (fresh process per rotation)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    q, k, v = _inputs(rank, n, True)
    _cplib_step(q, k, v, True, True, rotate)  # warm-up: lazy library state is not the ring's
    q.grad = k.grad = v.grad = None
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak (VmHWM) to the current RSS
    base = _rss_kib("VmRSS")
    _cplib_step(q, k, v, True, True, rotate)
    dist.barrier()
    return (_rss_kib("VmHWM") - base) / 1024.0


def _run_jobs(jobs):
    return [fn(*args) for fn, args in jobs]


def _run(n, jobs):
    return run_on_ranks(n, _run_jobs, jobs)


def _single_full(causal):
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, generator=g).requires_grad_(True) for _ in range(3))

    def step():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        out.backward(torch.ones_like(out))
    wall = timeit(step, warmup=1, iters=ITERS)
    cpu = []
    for _ in range(ITERS):
        t0 = time.process_time()
        step()
        cpu.append(time.process_time() - t0)
    return wall, sorted(cpu)[len(cpu) // 2]


def main() -> None:
    threads = torch.get_num_threads()
    single = {c: _single_full(c) for c in (True, False)}
    torch.set_num_threads(threads)
    rows, payload = [], {"B": B, "H": H, "S": S, "D": D, "dtype": "float32", "rows": []}
    modes = [("causal+lb", True, True), ("non-causal", False, False)]
    for n in WORLDS:
        # torch's rotater has no send/recv method: only alltoall and allgather.
        jobs = [(_time_rank, (impl, c, lb, rot)) for _, c, lb in modes for rot in ROTATIONS
                for impl in ("cplib", "torch")
                if impl == "cplib" or (WITH_TORCH and rot != "p2p")]
        per_rank = _run(n, jobs)
        for j, (fn, (impl, c, lb, rot)) in enumerate(jobs):
            vals = [r[j] for r in per_rank]
            mode = "causal+lb" if c else "non-causal"
            ideal, ideal_cpu = single[c][0] / n, single[c][1] / n
            if any(isinstance(x, str) for x in vals):
                err = next(x for x in vals if isinstance(x, str))
                rows.append((n, mode, rot, impl, err, ideal, "-", "-", ideal_cpu, "-"))
                continue
            t, cpu = max(x[0] for x in vals), max(x[1] for x in vals)
            rows.append((n, mode, rot, impl, t, ideal, t / ideal, cpu, ideal_cpu, cpu / ideal_cpu))
            payload["rows"].append(dict(n=n, mode=mode, rotate=rot, impl=impl, seconds=t,
                                        ideal=ideal, ratio=t / ideal, cpu_seconds=cpu,
                                        ideal_cpu=ideal_cpu, cpu_ratio=cpu / ideal_cpu))
    print_table(f"ring fwd+bwd per rank, B={B} H={H} S={S} D={D} fp32, 1 thread/rank "
                f"(single-process full wall/cpu: causal {single[True][0]:.3f}/{single[True][1]:.3f}s, "
                f"non-causal {single[False][0]:.3f}/{single[False][1]:.3f}s)",
                ["N", "mode", "rotate", "impl", "wall s/rank", "ideal wall", "ratio",
                 "cpu s/rank", "ideal cpu", "cpu ratio"], rows)
    mem_rows = []
    # For the memory ranks only, every large buffer gets its own mapping, so
    # RSS tracks live memory (spawned ranks inherit the environment). The
    # timed ranks keep malloc's defaults, as the single-process baseline does.
    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    try:
        for rot in ROTATIONS if os.environ.get("CPLIB_BENCH_MEMORY", "1") == "1" else []:
            peaks = _run(4, [(_peak_memory, (rot,))])
            mem_rows.append((rot, max(p[0] for p in peaks)))
    finally:
        if saved is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_")
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
    ag = dict(mem_rows).get("allgather", float("nan"))
    mem_rows = [(r, m, m / ag) for r, m in mem_rows]
    if mem_rows:
        print_table("peak memory per rank beyond the inputs, N=4, causal+lb fwd+bwd (MiB)",
                    ["rotate", "MiB", "vs allgather"], mem_rows)
    payload["single_full"] = single
    payload["memory_mib"] = {r: m for r, m, _ in mem_rows}
    write_json("bench_ring_cpu", payload)
    ok = [r for r in payload["rows"] if r["impl"] == "cplib" and r["n"] == WORLDS[0]]
    plot("bench_ring_cpu", f"cplib ring fwd+bwd / ideal (S={S})", "config", "time / ideal",
         {rot: (list(range(len([r for r in ok if r["rotate"] == rot]))),
                [r["ratio"] for r in ok if r["rotate"] == rot]) for rot in ROTATIONS}, kind="bar")
    print(machine())


if __name__ == "__main__":
    main()
