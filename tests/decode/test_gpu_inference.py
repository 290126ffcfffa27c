"""Inference on CUDA tensors (GPU; CPLIB_GPU_TESTS_ON_CPU=1 runs the same
bodies on the CPU): a ``ShardedKVCache`` filled on the device (a prompt
dealt round-robin, then T new tokens) and ``decode_sdpa`` of the T newest
queries (T = 1 and 3, replicated) over it, MHA, GQA and MQA, with and
without a window, on 2 and 4 threaded ranks sharing one GPU; a cache of one
token (every rank but one holds nothing). bf16 and fp16 against fp64
truth: out and lse within 1.5x the single-device error, and the same bits on
every rank. Pass-Q prefill over a cache is in test_gpu_ring_features.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import cplib
from gpu_cases import DEVICE, GPU_MARKS, HALF_DTYPES, Case, assert_ok, judge, make_case, ranks
from gpu_cases import sync, visible

pytestmark = GPU_MARKS


def _decode_rank(case: Case, p: int, t: int, window) -> dict:
    cache = cplib.ShardedKVCache(dist.group.WORLD, 2)
    for count in (p, t):  # the prompt, then the new tokens (their k/v cached too)
        start = cache.seq_len
        mine = start + cache.deal(count)
        for layer in range(2):  # layer 1 holds the same rows: its shard must equal layer 0's
            k, v = cache.update(layer, case.k[:, :, mine].to(DEVICE), case.v[:, :, mine].to(DEVICE))
    assert torch.equal(cache.positions, torch.sort(cache.positions).values)
    out, lse = cplib.decode_sdpa(case.q.to(DEVICE), k, v, dist.group.WORLD,
                                 q_positions=torch.arange(p, p + t),
                                 kv_positions=cache.positions, window=window)
    sync()
    return dict(out=out.cpu(), lse=lse.cpu(), rows=len(cache), bytes=cache.memory_bytes())


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=["bf16", "fp16"])
def test_decode_over_a_sharded_cache(world_size, dtype):
    n, failures, count = world_size, [], 0
    settings = [(p, t, hkv, window) for p, t in ((40 * n + 3, 1), (40 * n + 3, 3))
                for hkv, window in ((4, None), (2, 7), (1, None))]
    settings.append((0, 1, 2, None))  # one token: every rank but one holds nothing
    for i, (p, t, hkv, window) in enumerate(settings):
        see = visible(torch.arange(p, p + t), torch.arange(p + t), causal=True, window=window)
        case = make_case(2, 4, hkv, t, p + t, 64, dtype, 400 + i, see, grads=False,
                         what=f"{dtype} decode P={p} T={t} hkv={hkv} window={window}")
        per_rank = ranks(n, _decode_rank, case, p, t, window)
        assert sum(r["rows"] for r in per_rank) == p + t
        for r in per_rank[1:]:
            assert torch.equal(r["out"], per_rank[0]["out"]), "ranks disagree on out"
            assert torch.equal(r["lse"], per_rank[0]["lse"]), "ranks disagree on lse"
        got = {k: per_rank[0][k].double() for k in ("out", "lse")}
        failures += judge(case, got, ("out", "lse"), what=f"n={n}")
        count += 1
    assert_ok(failures, count)
