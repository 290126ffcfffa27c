"""Context-parallel inference on CPU (gloo, one thread per rank, N = 4).

1. Prefill over a persistent cache: T new tokens (round-robin) against P + T
   cached keys (P in contiguous chunks), causal, forward only, pass-KV against
   pass-Q as the new fraction T / (T + P) goes from 1/64 to 1 at fixed
   T + P; the measured crossover beside the one ``ring_pass="auto"`` predicts
   from the bytes each moves (``cplib.ring_pass_auto``), with the bytes sent.
2. Decode: ``cplib.decode_sdpa`` of one new token against a sharded cache of
   P tokens, latency per token (one attention layer) against one process
   attending the whole cache, at P = 64K and a larger P.
3. Memory: cached bytes per rank (``ShardedKVCache.memory_bytes``) against
   the whole cache in one process (expected: ~1/N).

    python benchmarks/bench_inference.py
    CPLIB_BENCH_INF_S=4096 CPLIB_BENCH_INF_DECODE=65536 python benchmarks/bench_inference.py
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import (interleaved, machine, plot, print_table, run_on_ranks, timeit,  # noqa: E402
                    write_json)

N = 4
HQ, HKV, D = 8, 2, 64
S = int(os.environ.get("CPLIB_BENCH_INF_S", "8192"))
DECODE_P = [int(x) for x in os.environ.get("CPLIB_BENCH_INF_DECODE", "65536,1048576").split(",")]
ITERS = int(os.environ.get("CPLIB_BENCH_ITERS", "5"))
FRACTIONS = [1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1]


def _prefill_rank(s: int, fractions, iters: int):
    import cplib
    from cplib.comm.native import ops

    g = torch.Generator().manual_seed(dist.get_rank())
    rows = []
    for f in fractions:
        t = max(1, round(s * f))
        p = s - t
        cache = cplib.ShardedKVCache(dist.group.WORLD, 1)
        cache.deal(p, contiguous=True)
        qpos = p + cache.deal(t)
        kvpos = cache.positions.clone()
        q = torch.randn(1, HQ, qpos.numel(), D, generator=g)
        k = torch.randn(1, HKV, kvpos.numel(), D, generator=g)
        v = torch.randn(1, HKV, kvpos.numel(), D, generator=g)

        def run(ring_pass):
            with torch.no_grad():
                cplib.ring_sdpa(q, k, v, dist.group.WORLD, is_causal=True, q_positions=qpos,
                                kv_positions=kvpos, ring_pass=ring_pass)
        sent = {}
        for ring_pass in ("kv", "q"):
            dist.barrier()
            ops.ring_debug_bytes_sent(True)
            run(ring_pass)
            sent[ring_pass] = ops.ring_debug_bytes_sent(True)
        times = interleaved({"kv": lambda: run("kv"), "q": lambda: run("q")}, iters,
                            sync=dist.barrier)
        rows.append((f, t, p, times["kv"], times["q"], sent["kv"], sent["q"]))
    return rows


def _decode_rank(p_list, iters: int):
    import cplib

    rank = dist.get_rank()
    out = []
    for p in p_list:
        cache = cplib.ShardedKVCache(dist.group.WORLD, 1)
        mine = cache.deal(p)
        g = torch.Generator().manual_seed(rank)
        k, v = (torch.randn(1, HKV, mine.numel(), D, generator=g) for _ in range(2))
        k_all, v_all = cache.update(0, k, v)
        del k, v
        q = torch.randn(1, HQ, 1, D, generator=torch.Generator().manual_seed(7))
        qpos = torch.tensor([p])

        def step():
            cplib.decode_sdpa(q, k_all, v_all, dist.group.WORLD, q_positions=qpos,
                              kv_positions=cache.positions)
        sec = timeit(step, warmup=2, iters=iters, sync=dist.barrier)
        out.append((p, sec, cache.memory_bytes()))
        cache = k_all = v_all = None  # freed before the next P (step reads them)
    return out


def _decode_one_process(p: int, iters: int) -> float:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1, HKV, p, D, generator=g) for _ in range(2))
    q = torch.randn(1, HQ, 1, D, generator=g)
    return timeit(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), warmup=2,
                  iters=iters)


def main() -> None:
    import cplib

    t_start = time.time()
    results = run_on_ranks(N, _prefill_rank, S, FRACTIONS, ITERS)
    table = []
    measured = None
    for i, (f, t, p, kv, q, _, _) in enumerate(results[0]):
        kv_s = max(r[i][3] for r in results)
        q_s = max(r[i][4] for r in results)
        sent_kv = sum(r[i][5] for r in results)
        sent_q = sum(r[i][6] for r in results)
        auto = cplib.ring_pass_auto(t, t + p, HQ, HKV, D)
        faster = "q" if q_s < kv_s else "kv"
        if faster == "kv" and measured is None:
            measured = f
        table.append((f"1/{round(1 / f)}" if f < 1 else "1", t, p, kv_s * 1e3, q_s * 1e3,
                      kv_s / q_s, sent_kv / 2 ** 20, sent_q / 2 ** 20, auto, faster))
    # The rule's threshold: the largest fraction at which pass-Q moves fewer bytes.
    rule = max((f for f in FRACTIONS
                if cplib.ring_pass_auto(max(1, round(S * f)), S, HQ, HKV, D) == "q"), default=0)
    title = (f"Prefill over a cache, pass-KV vs pass-Q (N={N}, T+P={S}, Hq={HQ}, Hkv={HKV}, "
             f"D={D}, fp32, causal, forward)")
    text = print_table(title, ["T/(T+P)", "T", "P", "pass-KV ms", "pass-Q ms", "KV/Q",
                               "KV MiB sent", "Q MiB sent", "auto", "faster"], table)
    print(f"auto picks pass-Q up to T/(T+P) = {rule:.4g}; measured: pass-KV first faster at "
          f"{measured}", flush=True)

    dec = run_on_ranks(N, _decode_rank, DECODE_P, ITERS)
    dec_table = []
    for i, p in enumerate(DECODE_P):
        cp_s = max(r[i][1] for r in dec)
        per_rank = [r[i][2] for r in dec]
        one = _decode_one_process(p, ITERS)
        whole = 2 * p * HKV * D * 4
        dec_table.append((p, cp_s * 1e3, one * 1e3, one / cp_s, max(per_rank) / 2 ** 20,
                          whole / 2 ** 20, max(per_rank) / whole))
    dec_text = print_table(f"Decode, one token, one layer (N={N}, Hq={HQ}, Hkv={HKV}, D={D}, "
                           "fp32)", ["P", "cp ms/token", "one process ms/token", "speedup",
                                     "cache MiB per rank", "whole cache MiB", "per rank/whole"],
                           dec_table)
    write_json("bench_inference", {"machine": machine(), "prefill": table, "rule_threshold": rule,
                                   "measured_crossover": measured, "decode": dec_table,
                                   "seconds": time.time() - t_start})
    xs = FRACTIONS
    plot("bench_inference", title, "new fraction T/(T+P)", "ms (forward, slowest rank)",
         {"pass-KV": (xs, [r[3] for r in table]), "pass-Q": (xs, [r[4] for r in table])})
    print("\n" + text + "\n\n" + dec_text)


if __name__ == "__main__":
    main()
