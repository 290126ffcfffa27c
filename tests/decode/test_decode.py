"""decode_sdpa: the newest T tokens (T = 1 and 3, replicated) against a KV
cache sharded round-robin (interleaved positions) over 2 and 4 ranks, MHA,
GQA and MQA, with and without a window, a rank with no key at all, against
fp64 attention over the whole cache with the same mask (out, lse), the same
bits on every rank; check mode catches q shapes that differ between ranks;
opcheck and fullgraph compile."""

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


def check_decode(p: int, t: int, *, hq: int, hkv: int, d: int = 8, window=None,
                 seed: int = 0) -> None:
    """P tokens cached round-robin, then T new ones (their k/v cached too)."""
    s = p + t
    cache = cplib.ShardedKVCache(dist.group.WORLD, 1)
    cache.deal(p)
    cache.deal(t)
    kvpos = cache.positions
    q = global_tensor((1, hq, s, d), torch.float64, seed)
    k = global_tensor((1, hkv, s, d), torch.float64, seed + 1)
    v = global_tensor((1, hkv, s, d), torch.float64, seed + 2)
    rows = torch.arange(p, s)
    mask = visible(s, causal=True, window=window)[rows]
    ref_out, ref_lse, *_ = masked_reference(q[:, :, rows], k, v, torch.zeros(1, hq, t, d), mask)
    out, lse = cplib.decode_sdpa(q[:, :, rows], k[:, :, kvpos], v[:, :, kvpos], dist.group.WORLD,
                                 q_positions=rows, kv_positions=kvpos, window=window)
    assert_close(out, ref_out, **TOL, what="out")
    assert_close(lse, ref_lse, **TOL, what="lse")
    both = torch.cat([out.flatten(), lse.flatten()])
    gathered = [torch.empty_like(both) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, both)
    assert all(torch.equal(g, both) for g in gathered), "ranks disagree"


def _check_decode() -> int:
    n = dist.get_world_size()
    count = 0
    for t in (1, 3):
        for hq, hkv in ((4, 4), (4, 2), (4, 1)):  # MHA, GQA, MQA
            for window in (None, 5):
                check_decode(6 * n + 1, t, hq=hq, hkv=hkv, window=window, seed=t + hq + hkv)
                count += 1
    # fewer cached tokens than ranks (a rank holds nothing), and a window that
    # leaves most ranks without a visible key
    check_decode(0, 1, hq=2, hkv=1)
    check_decode(2 * n, 1, hq=2, hkv=2, window=0)
    # no positions: every query sees every key
    kv = global_tensor((1, 1, 3 * n, 8), torch.float64, 9)
    q = global_tensor((1, 2, 2, 8), torch.float64, 10)
    ref_out, ref_lse, *_ = masked_reference(q, kv, kv, torch.zeros(1, 2, 2, 8),
                                            torch.ones(2, 3 * n, dtype=torch.bool))
    mine = kv.chunk(n, dim=2)[dist.get_rank()]
    out, lse = cplib.decode_sdpa(q, mine, mine, dist.group.WORLD)
    assert_close(out, ref_out, **TOL, what="out (no positions)")
    assert_close(lse, ref_lse, **TOL, what="lse (no positions)")
    return count + 3


@pytest.mark.parametrize("world_size", [2, 4])
def test_decode_matches_reference(ranks, world_size):
    counts = ranks(world_size).run(_check_decode)
    assert counts[0] == 15 and len(set(counts)) == 1


def _check_errors() -> int:
    rank = dist.get_rank()
    g = dist.group.WORLD
    kv = torch.randn(1, 1, 4, 8)
    pos = torch.arange(4) * 2 + rank
    q = torch.randn(1, 2, 1, 8, generator=torch.Generator().manual_seed(1))
    qp = torch.tensor([20])
    raised = 0
    for kw, needle in ((dict(q_positions=qp.float(), kv_positions=pos), "q_positions"),
                       (dict(q_positions=qp, kv_positions=pos[:3]), "kv_positions"),
                       (dict(q_positions=qp), "kv_positions"),
                       (dict(window=3), "window")):
        try:
            cplib.decode_sdpa(q, kv, kv, g, **kw)
        except ValueError as e:
            assert needle in str(e), str(e)
            raised += 1
    with cplib.consistency_checks():
        # q's shape is compared (its values are the caller's contract: comparing
        # them would read q back from the GPU at every token)
        try:
            cplib.decode_sdpa(q.repeat(1, 1 + rank, 1, 1), kv, kv, g, q_positions=qp,
                              kv_positions=pos)
        except ValueError as e:
            assert "disagree on q.size(1)" in str(e), str(e)
            raised += 1
        # the same q everywhere passes the check
        cplib.decode_sdpa(q, kv, kv, g, q_positions=qp, kv_positions=pos)
    dist.barrier()
    return raised


@pytest.mark.parametrize("world_size", [2])
def test_decode_bad_input_raises_on_every_rank(ranks, world_size):
    assert ranks(world_size).run(_check_errors) == [5] * world_size


def _check_compile() -> int:
    rank = dist.get_rank()
    name = dist.group.WORLD.group_name
    kv = torch.randn(1, 1, 5, 8, dtype=torch.float64)
    pos = torch.arange(5) * 2 + rank
    q = torch.randn(1, 2, 3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    qp = torch.tensor([10, 11, 12])
    torch.library.opcheck(ops.decode_sdpa.default, (q, kv, kv, name, qp, pos, [4, 0], None))

    def f(q, k, v):
        out, lse = cplib.decode_sdpa(q, k, v, name, q_positions=qp, kv_positions=pos, window=4)
        return out * 2, lse

    got = torch.compile(f, backend="aot_eager", fullgraph=True)(q, kv, kv)
    want = f(q, kv, kv)
    assert_close(got[0], want[0], atol=0, rtol=0, what="compiled out")
    assert_close(got[1], want[1], atol=0, rtol=0, what="compiled lse")
    return 1


def test_decode_opcheck_and_fullgraph_compile(ranks):
    assert ranks(2).run(_check_compile) == [1, 1]
