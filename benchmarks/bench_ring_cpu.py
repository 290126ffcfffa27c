"""Ring attention on CPU (gloo, one thread per rank): cplib.ring_sdpa forward +
backward per rank against the ideal (single-process, one-thread full-sequence
SDPA forward + backward divided by N, measured in the same run), the three
rotations side by side, torch's own ring (its _templated_ring_attention driven
with the CPU flash kernel) where it runs, and peak memory per rank beyond the
inputs for the three rotations at N = 4.

``CPLIB_BENCH_SERIES=handshake`` measures what the handshake that begins
every op costs: one handshake alone (its all-gather and verdict), and the
ring's fwd+bwd (causal, head-tail, p2p: two handshakes) with it on and with
``CPLIB_CHECK_CONSISTENCY=0``, alternating call by call so that both see the
same machine load.

Two more series (``CPLIB_BENCH_SERIES``, default ``dense,window,documents``;
``window,documents`` runs just those): fwd+bwd time and bytes sent per rank
against the sliding-window size (causal, sequential, S=16384, N=4; expected:
time proportional to W), and 8 packed documents against the dense causal
ring of the same S (head-tail), each beside the single-process computation
with the same mask.

``CPLIB_BENCH_SERIES=placement`` runs benchmarks/bench_placement.py: the
document placement against per-document head-tail on three document mixes.

    python benchmarks/bench_ring_cpu.py            # B=1, H=8, S=8192, D=64, fp32
    CPLIB_BENCH_SEQ=2048 python benchmarks/bench_ring_cpu.py   # quicker
    CPLIB_BENCH_SERIES=window,documents python benchmarks/bench_ring_cpu.py
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import (cpu_seconds, machine, plot, print_table, run_on_ranks, time_full_sdpa, timeit,  # noqa: E402
                    write_json)

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



def _time_rank(impl, causal, lb, rotate):
    rank, n = dist.get_rank(), dist.get_world_size()
    q, k, v = _inputs(rank, n, lb)
    step = _cplib_step if impl == "cplib" else _torch_step
    try:
        t = timeit(lambda: step(q, k, v, causal, lb, rotate), warmup=1, iters=ITERS,
                   sync=dist.barrier)
        cpu = cpu_seconds(lambda: step(q, k, v, causal, lb, rotate), ITERS)
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
    return time_full_sdpa((B, H, S, D), causal, ITERS)


# ------------------------------------------------- windows and documents

MASKED_S = int(os.environ.get("CPLIB_BENCH_MASKED_SEQ", "16384"))
MASKED_N = 4
MASKED_H = int(os.environ.get("CPLIB_BENCH_MASKED_HEADS", "2"))


def _masked_step(q, k, v, causal, lb, rotate, cu_seqlens, window, per_document):
    import cplib
    out, _ = cplib.ring_sdpa(q, k, v, dist.group.WORLD, is_causal=causal, load_balanced=lb,
                             rotate=rotate, cu_seqlens=cu_seqlens, window=window,
                             seq_len=MASKED_S, per_document=per_document)
    out.backward(torch.ones_like(out))


def _time_masked(causal, lb, rotate, cu_seqlens, window, per_document=False):
    """(wall s, bytes sent fwd+bwd) of one rank."""
    from cplib.comm.native import ops
    from cplib.attention.layout import shard_positions
    rank, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    pos = shard_positions(MASKED_S, n, rank, lb,
                          documents=cu_seqlens if per_document else None)
    q, k, v = (torch.randn(B, MASKED_H, MASKED_S, D, generator=g)[:, :, pos].contiguous()
               .requires_grad_(True) for _ in range(3))
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens)
    fn = lambda: _masked_step(q, k, v, causal, lb, rotate, cu, window, per_document)  # noqa
    dist.barrier()
    ops.ring_debug_bytes_sent(True)
    fn()
    sent = ops.ring_debug_bytes_sent(True)
    return timeit(fn, warmup=0, iters=ITERS, sync=dist.barrier), sent


def _single_masked(cu_seqlens):
    """Causal attention in one process, one thread: one SDPA call per
    document (the whole sequence when there are none), the ideal the ring is
    measured against (/N per rank)."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, MASKED_H, MASKED_S, D, generator=g).requires_grad_(True)
               for _ in range(3))
    bounds = cu_seqlens or [0, MASKED_S]

    def step():
        outs = [F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b],
                                               is_causal=True)
                for a, b in zip(bounds, bounds[1:])]
        torch.cat(outs, 2).backward(torch.ones(B, MASKED_H, MASKED_S, D))
    return timeit(step, warmup=0, iters=1)


def _visible_fraction(s: int, w: int) -> float:
    """Visible (query, key) pairs of a causal window w over the causal ones."""
    band = sum(min(i, w) + 1 for i in range(s))
    return band / (s * (s + 1) / 2)


def masked_series() -> None:
    series = os.environ.get("CPLIB_BENCH_SERIES", "dense,window,documents").split(",")
    n, s = MASKED_N, MASKED_S
    payload = {"B": B, "H": MASKED_H, "S": s, "D": D, "N": n, "dtype": "float32"}
    threads = torch.get_num_threads()
    if "window" in series:
        windows = [256, 1024, 2048, 4096, 8192, s]
        jobs = [(_time_masked, (True, False, "p2p", None, w)) for w in windows]
        per_rank = _run(n, jobs)
        ideal_dense = _single_masked(None) / n
        rows, data = [], []
        for j, w in enumerate(windows):
            t = max(r[j][0] for r in per_rank)
            sent = max(r[j][1] for r in per_rank)
            ideal = ideal_dense * _visible_fraction(s, w)
            rows.append((w, t, t / w * 1e3, sent / 2**20, ideal, t / ideal))
            data.append(dict(window=w, seconds=t, bytes_sent_max_rank=sent, ideal=ideal))
        print_table(f"sliding window, causal, sequential, p2p: fwd+bwd per rank, N={n}, S={s}, "
                    f"B={B} H={MASKED_H} D={D} fp32 (ideal: single-process dense causal / N "
                    f"= {ideal_dense:.3f}s, times the visible fraction of the window)",
                    ["window W", "s/rank", "ms per 1k W", "MiB sent (max rank)",
                     "ideal", "ratio"], rows)
        payload["window"] = data
        payload["window_ideal_dense"] = ideal_dense
        plot("bench_ring_window", f"ring fwd+bwd vs window (S={s}, N={n})", "window W",
             "seconds / rank", {"cplib p2p": ([r["window"] for r in data],
                                              [r["seconds"] for r in data])})
    if "documents" in series:
        from cplib.attention.names import layout_of, layout_words

        g = torch.Generator().manual_seed(1)
        cuts = sorted((torch.randperm(s - 1, generator=g)[:7] + 1).tolist())
        docs = [0] + cuts + [s]
        jobs = [(_time_masked, (True, True, rot, cu, None, per_doc))
                for cu, per_doc in ((None, False), (docs, False), (docs, True))
                for rot in ("p2p", "allgather")]
        per_rank = _run(n, jobs)
        ideal = {"dense": _single_masked(None) / n, "8 docs": _single_masked(docs) / n}
        rows, data = [], []
        for j, (_, (c, lb, rot, cu, w, per_doc)) in enumerate(jobs):
            name = "8 docs" if cu else "dense"
            layout = layout_words(layout_of("bench", True, per_doc))
            t = max(r[j][0] for r in per_rank)
            sent = max(r[j][1] for r in per_rank)
            rows.append((name, layout, rot, t, sent / 2**20, ideal[name], t / ideal[name]))
            data.append(dict(mask=name, layout=layout, rotate=rot, seconds=t,
                             bytes_sent_max_rank=sent, ideal=ideal[name]))
        print_table(f"packed documents (lengths {[b - a for a, b in zip(docs, docs[1:])]}) vs "
                    f"dense, causal: fwd+bwd per rank, N={n}, S={s}, B={B} "
                    f"H={MASKED_H} D={D} fp32 (ideal: single-process SDPA, same mask, / N)",
                    ["mask", "layout", "rotate", "s/rank", "MiB sent (max rank)", "ideal",
                     "ratio"], rows)
        payload["documents"] = data
        payload["document_lengths"] = [b - a for a, b in zip(docs, docs[1:])]
    torch.set_num_threads(threads)
    if "window" in series or "documents" in series:
        write_json("bench_ring_masked", payload)
        print(machine())


def _time_handshake(iters: int):
    """Per rank: median wall and CPU seconds of one handshake alone, and of
    the ring's fwd+bwd with the handshake on and off (alternating)."""
    import time

    import cplib  # noqa: F401  (loads the ops)
    rank, n = dist.get_rank(), dist.get_world_size()
    name = dist.group.WORLD.group_name
    hs = lambda: torch.ops.cplib_c.handshake(name, "bench", [], [], [], [], [])  # noqa: E731
    for _ in range(20):
        hs()
    alone_wall, alone_cpu = [], []
    for _ in range(200):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        hs()
        alone_wall.append(time.perf_counter() - t0)
        alone_cpu.append(time.process_time() - c0)
    q, k, v = _inputs(rank, n, True)
    step = lambda: _cplib_step(q, k, v, True, True, "p2p")  # noqa: E731
    step()
    ring = {"on": ([], []), "off": ([], [])}
    for i in range(2 * iters):
        mode = "on" if i % 2 == 0 else "off"
        if mode == "off":
            os.environ["CPLIB_CHECK_CONSISTENCY"] = "0"
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        ring[mode][0].append(time.perf_counter() - t0)
        ring[mode][1].append(time.process_time() - c0)
        os.environ.pop("CPLIB_CHECK_CONSISTENCY", None)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return (med(alone_wall), med(alone_cpu), med(ring["on"][0]), med(ring["on"][1]),
            med(ring["off"][0]), med(ring["off"][1]))


def handshake_series() -> None:
    rows, payload = [], {"S": S, "rows": []}
    for n in WORLDS:
        per_rank = run_on_ranks(n, _time_handshake, ITERS)
        hw, hc, on_w, on_c, off_w, off_c = (max(r[i] for r in per_rank) for i in range(6))
        # fwd + bwd: two handshakes per step.
        rows.append((n, hw * 1e6, hc * 1e6, on_w, off_w, 2 * hw / off_w * 100, on_c, off_c,
                     2 * hc / off_c * 100))
        payload["rows"].append(dict(n=n, handshake_wall_s=hw, handshake_cpu_s=hc,
                                    ring_on_wall_s=on_w, ring_off_wall_s=off_w,
                                    ring_on_cpu_s=on_c, ring_off_cpu_s=off_c))
    print_table(f"handshake cost, ring fwd+bwd causal+lb p2p, B={B} H={H} S={S} D={D} fp32",
                ["N", "handshake wall us", "handshake cpu us", "ring on wall s",
                 "ring off wall s", "2 handshakes / ring wall %", "ring on cpu s",
                 "ring off cpu s", "2 handshakes / ring cpu %"], rows)
    write_json("bench_ring_cpu_handshake", payload)
    print(machine())


def main() -> None:
    if os.environ.get("CPLIB_BENCH_SERIES") == "handshake":
        handshake_series()
        return
    if os.environ.get("CPLIB_BENCH_SERIES") == "placement":  # bench_placement.py's table
        from bench_placement import main as placement_main
        placement_main()
        return
    if "dense" not in os.environ.get("CPLIB_BENCH_SERIES", "dense,window,documents").split(","):
        masked_series()
        return
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
                f"(single-process full wall/cpu: causal "
                f"{single[True][0]:.3f}/{single[True][1]:.3f}s, "
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
    masked_series()


if __name__ == "__main__":
    main()
