"""ring_sdpa against single-process scaled_dot_product_attention on the full
sequence (fp64 reference): out, lse, dq, dk, dv at world sizes 1, 2, 4 over
causal/non-causal, load balance on/off, the three rotations, Hq/Hkv 1, 2, 4,
D 32/64/128, B 1/2 and non-contiguous inputs; the bf16 drift criterion; and
the bytes GQA saves on the wire."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import cplib
from cplib.comm.native import ops
from ring_cases import ROTATIONS, _run_case, global_tensor, reference, shard_seq

WORLD_SIZES = [1, 2, 4]


def _matrix(dtype, world_size: int) -> list[tuple]:
    """Every (causal, load balance, rotation) with three variants each, so every
    rotation meets every head ratio, head dim, batch and layout."""
    heads = [(4, 4), (4, 2), (4, 1), (2, 2), (2, 1), (1, 1)]
    dims = [32, 64, 128]
    cases = []
    for i, (causal, lb, rotate) in enumerate(itertools.product((False, True), (False, True),
                                                               ROTATIONS)):
        for j in range(3):
            hq, hkv = heads[(i + 2 * j) % len(heads)]
            d = dims[(i + j) % 3]
            b = 1 + (i + j) % 2
            noncontig = (i // 3 + j) % 2 == 1
            s_local = [8, 12, 16][j] if lb else [9, 8, 11][(i + j) % 3]
            if world_size > 1 and d == 128:
                s_local = min(s_local, 9 if not lb else 8)
            cases.append((dtype, causal, lb, rotate, hq, hkv, d, b, s_local, noncontig))
    return cases


def _check_matrix(dtype) -> int:
    cases = _matrix(dtype, dist.get_world_size())
    for seed, case in enumerate(cases):
        _run_case(*case, seed=seed)
    # scale is honoured (and tiny ring shards: one row per chunk)
    _run_case(dtype, True, True, "p2p", 4, 2, 32, 1, 2, False, scale=0.3, seed=99)
    _run_case(dtype, False, False, "alltoall", 2, 1, 32, 2, 1, False, scale=1.7, seed=98)
    return len(cases) + 2


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_ring_sdpa_matches_full_sequence_reference(ranks, world_size, dtype):
    counts = ranks(world_size).run(_check_matrix, dtype)
    assert counts == [36 + 2] * world_size


# ---------------------------------------------------------------- bf16 drift


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative error over the global tensor (sums of squares reduced over ranks)."""
    sums = torch.stack([(got.double() - want).pow(2).sum(), want.pow(2).sum()])
    dist.all_reduce(sums)
    return (sums[0] / sums[1]).sqrt().item()


def _check_bf16_drift() -> list[str]:
    rank, n = dist.get_rank(), dist.get_world_size()
    report = []
    for causal, lb, rotate, hkv in ((True, True, "p2p", 4), (False, False, "alltoall", 2),
                                    (True, False, "allgather", 4)):
        b, hq, s, d = 2, 4, 64 * n, 64
        q, k, v, cot = (global_tensor((b, h, s, d), torch.bfloat16, 10 + i)
                        for i, h in enumerate((hq, hkv, hkv, hq)))
        ref = reference(q, k, v, cot, is_causal=causal, scale=None)
        # single device bf16 SDPA on the same data
        qs, ks, vs = (t.clone().requires_grad_(True) for t in (q, k, v))
        F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal,
                                       enable_gqa=True).backward(cot)
        single = [qs.grad, ks.grad, vs.grad]
        # the ring
        ql, kl, vl = (shard_seq(t, rank, n, lb).clone().requires_grad_(True) for t in (q, k, v))
        out, _ = cplib.ring_sdpa(ql, kl, vl, dist.group.WORLD, is_causal=causal,
                                 load_balanced=lb, rotate=rotate)
        out.backward(shard_seq(cot, rank, n, lb))
        for name, got, sgl, want in zip(("dq", "dk", "dv"), (ql.grad, kl.grad, vl.grad),
                                        single, ref[2:]):
            ring_err = _rel_err(got, shard_seq(want, rank, n, lb))
            single_err = _rel_err(shard_seq(sgl, rank, n, lb), shard_seq(want, rank, n, lb))
            report.append(f"{name} causal={causal} lb={lb} {rotate}: ring {ring_err:.3e} "
                          f"single {single_err:.3e}")
            assert ring_err <= 1.5 * single_err, report[-1]
    return report


def test_ring_sdpa_bf16_gradient_drift(ranks):
    report = ranks(4).run(_check_bf16_drift)[0]
    print("\n".join(report))


# ---------------------------------------------------------------- bytes on the wire


def _bytes_for(rotate: str, hkv: int, backward: bool) -> int:
    b, hq, s_local, d = 2, 4, 8, 32
    n = dist.get_world_size()
    q = torch.randn(b, hq, s_local, d, requires_grad=True)
    k = torch.randn(b, hkv, s_local, d, requires_grad=True)
    v = torch.randn(b, hkv, s_local, d, requires_grad=True)
    dist.barrier()
    ops.ring_debug_bytes_sent(True)
    out, _ = cplib.ring_sdpa(q, k, v, dist.group.WORLD, rotate=rotate)
    if backward:
        ops.ring_debug_bytes_sent(True)
        out.sum().backward()
    sent = ops.ring_debug_bytes_sent(True)
    kv_block = 2 * b * hkv * s_local * d * 4  # k and v, float32, Hkv heads
    if not backward:
        assert sent == (n - 1) * kv_block, (rotate, hkv, sent)
    elif rotate == "allgather":  # payloads: the gather, then the gradients reduce-scattered
        assert sent == 2 * (n - 1) * kv_block, (rotate, hkv, sent)
    else:  # k/v go to the N-1 others, each block's gradient comes back from them
        assert sent == 2 * (n - 1) * kv_block, (rotate, hkv, sent)
    return sent


def _check_bytes() -> dict:
    got = {}
    for rotate in ROTATIONS:
        for backward in (False, True):
            per_hkv = {hkv: _bytes_for(rotate, hkv, backward) for hkv in (1, 2, 4)}
            assert per_hkv[4] == 2 * per_hkv[2] == 4 * per_hkv[1] > 0, per_hkv
            got[(rotate, backward)] = per_hkv
    return got


@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_sdpa_gqa_bytes_scale_with_kv_heads(ranks, world_size):
    ranks(world_size).run(_check_bytes)
