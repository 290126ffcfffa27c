"""ring_sdpa on explicit positions: T new queries against a persistent cache
of P + T keys (P cached in contiguous chunks, T dealt round-robin by
cplib.ShardedKVCache; P and T not multiples of N; a rank with no query),
ring_pass "kv", "q" and "auto", MHA and GQA, windows, documents, unsorted
keys, every rotation, against fp64 attention over the whole sequence with the
same positional mask (out, lse; dq, dk, dv with "kv"). pass-Q moves fewer
bytes where "auto" picks it; bad positions raise ValueError on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import cplib
from cplib.comm.native import ops
from harness import assert_close
from ring_cases import global_tensor
from ring_mask_cases import masked_reference, visible

TOL = dict(atol=1e-10, rtol=1e-10)


def cache_layout(p: int, t: int, *, shuffle: bool = False):
    """(q positions, kv positions) of this rank: P cached tokens in contiguous
    chunks, then T new ones round-robin (``shuffle``: k/v rows out of order)."""
    cache = cplib.ShardedKVCache(dist.group.WORLD, 1)
    cache.deal(p, contiguous=True)
    qpos = p + cache.deal(t)
    kvpos = cache.positions.clone()
    if shuffle:
        kvpos = kvpos[torch.randperm(kvpos.numel(), generator=torch.Generator().manual_seed(3))]
    return qpos, kvpos


def check_case(p: int, t: int, *, hq: int = 2, hkv: int = 2, d: int = 8, causal: bool = True,
               window=None, cu_seqlens=None, ring_pass: str = "kv", rotate: str = "p2p",
               grad: bool = False, shuffle: bool = False, seed: int = 0) -> str:
    """One run against the fp64 reference; returns the pass the ring ran."""
    s = p + t
    qpos, kvpos = cache_layout(p, t, shuffle=shuffle)
    q = global_tensor((1, hq, s, d), torch.float64, seed)
    k = global_tensor((1, hkv, s, d), torch.float64, seed + 1)
    v = global_tensor((1, hkv, s, d), torch.float64, seed + 2)
    cot = global_tensor((1, hq, s, d), torch.float64, seed + 3)
    rows = torch.arange(p, s)
    mask = visible(s, causal=causal, cu_seqlens=cu_seqlens, window=window)[rows]
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = masked_reference(
        q[:, :, rows], k, v, cot[:, :, rows], mask)
    ql = q[:, :, qpos].clone().requires_grad_(grad)
    kl = k[:, :, kvpos].clone().requires_grad_(grad)
    vl = v[:, :, kvpos].clone().requires_grad_(grad)
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens)
    out, lse = cplib.ring_sdpa(ql, kl, vl, dist.group.WORLD, is_causal=causal, window=window,
                               cu_seqlens=cu, q_positions=qpos, kv_positions=kvpos,
                               ring_pass=ring_pass, rotate=rotate)
    ran = ops.ring_debug_last_pass()
    local = qpos - p
    assert_close(out, ref_out[:, :, local], **TOL, what="out")
    assert_close(lse, ref_lse[:, :, local], **TOL, what="lse")
    if grad:
        out.backward(cot[:, :, qpos])
        assert_close(ql.grad, ref_dq[:, :, local], **TOL, what="dq")
        assert_close(kl.grad, ref_dk[:, :, kvpos], **TOL, what="dk")
        assert_close(vl.grad, ref_dv[:, :, kvpos], **TOL, what="dv")
    return ran


def _check_prefill_over_cache() -> int:
    n = dist.get_world_size()
    count = 0
    for i, (p, t) in enumerate(((4 * n + 3, 2 * n + 1), (37, 11), (5, 3), (0, 3 * n + 2))):
        for hq, hkv in ((2, 2), (4, 1)):
            for ring_pass in ("kv", "q", "auto"):
                ran = check_case(p, t, hq=hq, hkv=hkv, ring_pass=ring_pass, seed=i + 7 * hq)
                if ring_pass != "auto":
                    assert ran == ring_pass
                else:
                    assert ran == cplib.ring_pass_auto(t, p + t, hq, hkv, 8,
                                                       dtype=torch.float64)
                count += 1
            # backward with kv, and auto under grad (it must pick kv)
            assert check_case(p, t, hq=hq, hkv=hkv, ring_pass="auto", grad=True, seed=i) == "kv"
            count += 1
    # windows (causal and two-sided), documents, unsorted keys, rotations
    for j, ring_pass in enumerate(("kv", "q")):
        rot = ("alltoall", "allgather")[j]
        check_case(29, 9, window=4, ring_pass=ring_pass, rotate=rot, grad=ring_pass == "kv")
        check_case(29, 9, causal=False, window=(3, 2), ring_pass=ring_pass, hq=4, hkv=2,
                   grad=ring_pass == "kv")
        check_case(29, 9, cu_seqlens=[0, 10, 31, 38], ring_pass=ring_pass, seed=4,
                   grad=ring_pass == "kv")
        check_case(29, 9, shuffle=True, ring_pass=ring_pass, seed=5, grad=ring_pass == "kv")
        count += 4
    # long shards: several tiles of q rows per block
    check_case(100, 270 * n, hq=1, hkv=1, d=4, window=(400, None), grad=True, seed=6)
    check_case(100, 270 * n, hq=1, hkv=1, d=4, ring_pass="q", seed=6)
    return count + 2


@pytest.mark.parametrize("world_size", [2, 4])
def test_prefill_over_cache_matches_reference(ranks, world_size):
    counts = ranks(world_size).run(_check_prefill_over_cache)
    assert counts == [42] * world_size


# ------------------------------------------------- what "auto" saves, and errors


def _check_pass_q_traffic() -> list[int]:
    """Bytes sent by the whole group with each pass, a short chunk over a long cache."""
    sent = []
    qpos, kvpos = cache_layout(64, 4)
    for ring_pass in ("kv", "q"):
        q = torch.randn(1, 4, qpos.numel(), 8)
        kv = torch.randn(1, 1, kvpos.numel(), 8)
        dist.barrier()
        ops.ring_debug_bytes_sent(True)
        cplib.ring_sdpa(q, kv, kv, dist.group.WORLD, is_causal=True, q_positions=qpos,
                        kv_positions=kvpos, ring_pass=ring_pass)
        total = torch.tensor([ops.ring_debug_bytes_sent(True)])
        dist.all_reduce(total)
        sent.append(int(total))
    return sent


def test_pass_q_moves_fewer_bytes_where_auto_picks_it(ranks):
    (kv, q), *_ = ranks(4).run(_check_pass_q_traffic)
    assert cplib.ring_pass_auto(4, 68, 4, 1, 8) == "q"
    assert 0 < q < kv
    assert cplib.ring_pass_auto(68, 68, 4, 1, 8) == "kv"
    assert cplib.ring_pass_auto(1, 68, 4, 1, 8, requires_grad=True) == "kv"


def _expect_value_error(fn, *needles: str) -> None:
    try:
        fn()
    except ValueError as e:
        for needle in needles:
            assert needle in str(e), str(e)
        return
    raise AssertionError(f"no ValueError mentioning {needles}")


def _check_bad_positions() -> int:
    qpos, kvpos = cache_layout(9, 5)
    q = torch.randn(1, 2, qpos.numel(), 4)
    kv = torch.randn(1, 2, kvpos.numel(), 4)
    g = dist.group.WORLD

    def call(**kw):
        args = dict(q_positions=qpos, kv_positions=kvpos, is_causal=True)
        args.update(kw)
        return lambda: cplib.ring_sdpa(q, kv, kv, g, **args)

    _expect_value_error(call(q_positions=qpos.double()), "q_positions", "integer")
    _expect_value_error(call(kv_positions=kvpos.view(1, -1)), "kv_positions", "1-D")
    _expect_value_error(call(q_positions=torch.cat([qpos, qpos])), "q_positions", "rows")
    _expect_value_error(call(kv_positions=kvpos[:-1]), "kv_positions", "rows")
    _expect_value_error(call(kv_positions=None), "kv_positions", "neither")
    _expect_value_error(call(q_positions=qpos - 100), "q_positions", "non-negative")
    _expect_value_error(call(load_balanced=True), "q_positions", "load_balanced")
    _expect_value_error(call(ring_pass="x"), "ring_pass")
    # the same checks inside the op (what a traced call or another binding reaches)
    _expect_value_error(lambda: ops.ring_sdpa(q, kv, kv, g.group_name, True,
                                              q_positions=qpos.float(), kv_positions=kvpos),
                        "q_positions", "integer")
    _expect_value_error(lambda: ops.ring_sdpa(q, kv, kv, g.group_name, True, q_positions=qpos,
                                              kv_positions=kvpos[1:]),
                        "kv_positions", "rows")
    qg, kg = q.clone().requires_grad_(True), kv.clone().requires_grad_(True)
    _expect_value_error(lambda: cplib.ring_sdpa(qg, kg, kg, g, q_positions=qpos,
                                                kv_positions=kvpos, ring_pass="q"),
                        'ring_pass="kv"')
    dist.barrier()  # every rank raised and no rank is left in a collective
    return 11


@pytest.mark.parametrize("world_size", [2, 4])
def test_bad_positions_raise_on_every_rank(ranks, world_size):
    assert ranks(world_size).run(_check_bad_positions) == [11] * world_size


def _check_compile() -> int:
    qpos, kvpos = cache_layout(13, 5)
    q = torch.randn(1, 2, qpos.numel(), 4, dtype=torch.float64)
    kv = torch.randn(1, 1, kvpos.numel(), 4, dtype=torch.float64)
    name = dist.group.WORLD.group_name
    torch.library.opcheck(ops.ring_sdpa.default, (q, kv, kv, name, True),
                          dict(q_positions=qpos, kv_positions=kvpos, ring_pass="q"))

    def f(q, k, v):
        return cplib.ring_sdpa(q, k, v, name, is_causal=True, q_positions=qpos,
                               kv_positions=kvpos, ring_pass="q")[0] * 2

    got = torch.compile(f, backend="aot_eager", fullgraph=True)(q, kv, kv)
    assert_close(got, f(q, kv, kv), atol=0, rtol=0, what="compiled")
    return 1


def test_positions_opcheck_and_fullgraph_compile(ranks):
    assert ranks(2).run(_check_compile) == [1, 1]
