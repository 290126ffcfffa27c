"""rotate="p2p" as a neighbour ring of point-to-point calls.

On a group whose backend batches point-to-point calls (NCCL), every
exchange of rotate="p2p" is one send and one receive, batched, that only
the two peers take part in (cplib/comm/collectives.py: _sends_point_to_point);
gloo groups run the same exchanges as split all-to-alls (cheaper on gloo's
host side, docs/comm.md). NCCL is not on this machine, so these tests take
the point-to-point route on gloo: the ring's out, lse and every gradient
against the fp64 reference and bit for bit against rotate="alltoall", for
dense, windowed and document rings (ranks that send or receive nothing at
some steps), the document placement and pass-Q over explicit positions; and
the calls it makes: one send and one receive per exchange, no all-to-all
but the handshake's once the group has exchanged."""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
import torch.distributed as dist

import cplib
import cplib.comm.collectives as collectives
from harness import assert_close
from ring_cases import global_tensor
from ring_mask_cases import check_ring, local

# (S, causal, load balanced, documents, window, layout keyword)
CASES = [
    (24, True, True, None, None, {}),
    (22, False, False, None, (3, 2), {}),
    (25, True, False, [0, 3, 11, 12, 25], None, {}),
    (26, True, True, [0, 7, 26], (5, 0), {"per_document": True}),
    (27, True, False, [0, 2, 9, 10, 27], None, {"placement": True}),
]


@contextlib.contextmanager
def point_to_point():
    """Neighbour exchanges as send/recv on this process's groups, gloo's too."""
    saved = collectives._sends_point_to_point
    collectives._sends_point_to_point = lambda pg, device: True
    try:
        yield
    finally:
        collectives._sends_point_to_point = saved


def _check_against_reference() -> int:
    with point_to_point():
        for i, (s, causal, lb, docs, window, layout) in enumerate(CASES):
            check_ring(s, causal=causal, lb=lb, rotate="p2p", cu_seqlens=docs, window=window,
                       hq=4, hkv=2, seed=10 * i, **layout)
    return len(CASES)


def _calls(fn) -> Counter:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return Counter(e.name for e in prof.events() if e.name.startswith("c10d::"))


def _check_same_as_alltoall() -> int:
    rank, n = dist.get_rank(), dist.get_world_size()
    s, docs = 9 * n + 2, [0, 5, 4 * n + 1, 9 * n + 2]
    q, k, v, cot = (global_tensor((2, h, s, 8), torch.float64, i)
                    for i, h in enumerate((4, 2, 2, 4)))
    cu = torch.tensor(docs)

    def run(rotate: str):
        ql, kl, vl = (local(t, s, True, docs).requires_grad_(True) for t in (q, k, v))
        out, lse = cplib.ring_sdpa(ql, kl, vl, dist.group.WORLD, is_causal=True,
                                   per_document=True, cu_seqlens=cu, seq_len=s, rotate=rotate)
        out.backward(local(cot, s, True, docs))
        return out, lse, ql.grad, kl.grad, vl.grad

    want = run("alltoall")
    with point_to_point():
        run("p2p")  # the group's first exchange may be an all-to-all: not counted
        got = []
        calls = _calls(lambda: got.extend(run("p2p")))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert_close(a, b, atol=0, rtol=0, what=f"p2p vs alltoall {name} rank {rank}")
    # One send and one receive per exchange a rank takes part in; the
    # all-to-all is the handshake's alone.
    assert calls["c10d::send"] > 0 and calls["c10d::recv_"] > 0, calls
    assert calls["c10d::alltoall_base_"] == 1, calls
    return 1


def _check_pass_q() -> int:
    # Explicit positions, queries travelling: rank r holds every N-th token.
    rank, n = dist.get_rank(), dist.get_world_size()
    s = 5 * n + 3
    pos = torch.arange(rank, s, n)
    q, k, v = (global_tensor((1, h, s, 8), torch.float64, 20 + i)[:, :, pos]
               for i, h in enumerate((4, 2, 2)))

    def run(rotate: str):
        return cplib.ring_sdpa(q, k, v, dist.group.WORLD, is_causal=True, q_positions=pos,
                               kv_positions=pos, ring_pass="q", rotate=rotate)

    want = run("alltoall")
    with point_to_point():
        got = run("p2p")
    for name, a, b in zip(("out", "lse"), got, want):
        assert_close(a, b, atol=0, rtol=0, what=f"pass-Q p2p vs alltoall {name} rank {rank}")
    return 1


@pytest.mark.parametrize("world_size", [2, 4])
def test_p2p_point_to_point_matches_reference(ranks, world_size):
    assert ranks(world_size).run(_check_against_reference) == [len(CASES)] * world_size


@pytest.mark.parametrize("world_size", [2, 4])
def test_p2p_point_to_point_is_the_alltoall_ring_bit_for_bit(ranks, world_size):
    pool = ranks(world_size)
    assert pool.run(_check_same_as_alltoall) == [1] * world_size
    assert pool.run(_check_pass_q) == [1] * world_size
