"""The all-gather path as Llama 3 runs it (cplib/ring/allgather.py): K/V
gathered once, one attention call per query chunk over the keys it can see,
no merge; the backward reduce-scatters dK/dV. At world sizes 1, 2 and 4
against the same attention on the whole sequence in one process: fp64 and
fp32 within rounding (out, dq, dk, dv), for causal (both layouts), not
causal, GQA, windows (one-sided, two-sided) and documents; bf16 within 1.5x
the error of one single-device bf16 SDPA call, both against fp64. One call
per query chunk and one gather each way are counted."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from cplib.ring.allgather import allgather_sdpa, query_chunks, visible_keys
from ring_cases import global_tensor, shard_seq
from ring_mask_cases import masked_reference, visible

CASES = [  # (causal, load balanced, hq, hkv, window, documents of S=64 per rank)
    (True, True, 4, 4, None, None), (True, False, 4, 2, None, None),
    (False, False, 4, 1, None, None), (False, True, 2, 2, None, None),
    (True, True, 4, 2, (9, 0), None), (False, False, 2, 1, (5, 11), None),
    (True, False, 2, 2, None, "docs"), (True, True, 4, 2, (7, 0), "docs"),
]


def _docs(s: int) -> list[int]:
    return [0, s // 3, s // 3 + 1, s - 5, s]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative error over the global tensor (sums reduced over ranks)."""
    sums = torch.stack([(got.double() - want).pow(2).sum(), want.pow(2).sum()])
    dist.all_reduce(sums)
    return (sums[0] / sums[1]).sqrt().item()


def _run(q, k, v, cot, case, dtype):
    """This rank's (out, dq, dk, dv) and the attention calls it made."""
    rank, n = dist.get_rank(), dist.get_world_size()
    causal, lb, _, _, window, docs = case
    s = q.shape[2]
    local = [shard_seq(t, rank, n, lb).to(dtype).clone().requires_grad_(i < 3)
             for i, t in enumerate((q, k, v, cot))]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = allgather_sdpa(*local[:3], dist.group.WORLD, is_causal=causal, load_balanced=lb,
                             window=window, cu_seqlens=_docs(s) if docs else None)
        out.backward(local[3])
    names = Counter(e.name for e in prof.events())
    return (out.detach(), *(t.grad for t in local[:3])), names


def _check(dtype) -> int:
    rank, n = dist.get_rank(), dist.get_world_size()
    checked = 0
    for i, case in enumerate(CASES):
        causal, lb, hq, hkv, window, docs = case
        s = 64 * n
        q, k, v, cot = (global_tensor((2, h, s, 16), torch.float64, 10 * i + j)
                        for j, h in enumerate((hq, hkv, hkv, hq)))
        mask = visible(s, causal=causal, window=window, cu_seqlens=_docs(s) if docs else None)
        want = masked_reference(q, k, v, cot, mask)
        got, names = _run(q, k, v, cot, case, dtype)
        # one call per query chunk (the forward's; the backward's kernel is its own op)
        chunks = len(query_chunks(s, n, rank, lb))
        assert names["aten::scaled_dot_product_attention"] == chunks, names
        assert names["cplib_c::flex_cp_allgather"] == (n > 1), names
        assert names["cplib_c::flex_cp_allgather_backward_covered"] == (n > 1), names
        tol = 1e-10 if dtype == torch.float64 else 2e-5
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, (want[0], *want[2:])):
            err = _rel(g, shard_seq(w, rank, n, lb))
            assert err <= tol, (case, name, err)
        checked += 1
    return checked


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_allgather_path_matches_one_process(ranks, world_size, dtype):
    assert ranks(world_size).run(_check, dtype) == [len(CASES)] * world_size


def _check_bf16() -> list[str]:
    rank, n = dist.get_rank(), dist.get_world_size()
    report = []
    for i, case in enumerate(CASES[:3] + CASES[4:5] + CASES[6:7]):
        causal, lb, hq, hkv, window, docs = case
        s = 64 * n
        q, k, v, cot = (global_tensor((2, hq if j in (0, 3) else hkv, s, 64), torch.bfloat16,
                                      40 + 10 * i + j) for j in range(4))
        mask = visible(s, causal=causal, window=window, cu_seqlens=_docs(s) if docs else None)
        want = masked_reference(q, k, v, cot, mask)
        qs, ks, vs = (t.clone().requires_grad_(True) for t in (q, k, v))
        F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=hq != hkv
                                       ).backward(cot)
        single = (None, qs.grad, ks.grad, vs.grad)
        got, _ = _run(q, k, v, cot, case, torch.bfloat16)
        for name, g, sgl, w in zip(("out", "dq", "dk", "dv"), got, single,
                                   (want[0], *want[2:])):
            if sgl is None:  # the single-device output of the same call
                with torch.no_grad():
                    sgl = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                         enable_gqa=hq != hkv)
            mine = _rel(g, shard_seq(w, rank, n, lb))
            theirs = _rel(shard_seq(sgl, rank, n, lb), shard_seq(w, rank, n, lb))
            report.append(f"{name} {case}: {mine:.3e} single {theirs:.3e}")
            assert mine <= 1.5 * theirs, report[-1]
    return report


@pytest.mark.parametrize("world_size", [2, 4])
def test_allgather_path_bf16_within_the_single_device_error(ranks, world_size):
    print("\n".join(ranks(world_size).run(_check_bf16)[0]))


def test_each_chunk_sees_its_prefix_and_nothing_else():
    # head-tail, S=64 over 2 ranks: rank 0's chunks [0, 16) and [48, 64)
    assert query_chunks(64, 2, 0, True) == [(0, 16), (48, 16)]
    assert visible_keys(48, 16, 64, True, None, None) == (0, 64)
    assert visible_keys(48, 16, 64, True, (7, 0), None) == (41, 64)
    assert visible_keys(48, 16, 64, False, (3, 5), None) == (45, 64)
    assert visible_keys(16, 16, 64, True, None, [0, 20, 64]) == (0, 32)
    assert visible_keys(24, 8, 64, True, None, [0, 20, 64]) == (20, 32)
