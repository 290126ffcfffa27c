"""ring_sdpa at any sequence length (uneven shards, no padding) against full
attention in one process (fp64: out, lse, dq, dk, dv) at world sizes 1, 2, 4:
prime S (1031), S = N and N + 1 (empty head-tail chunks), both layouts, every
rotation, causal and not; opcheck and torch.compile(fullgraph=True) with the
new arguments; S shorter than the world size and shards that do not match
seq_len raise ValueError on every rank before any communication."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import cplib
from cplib.comm.native import ops
from cplib.attention.layout import layout_indices, local_length, shard_positions
from ring_mask_cases import check_ring, local
from ring_cases import global_tensor

ROTATIONS = ["p2p", "alltoall", "allgather"]


def test_layout_pieces_cover_the_sequence():
    for s in (1, 7, 8, 16, 1031):
        for n in (1, 2, 3, 4, 8):
            if s < n:
                continue
            for ht in (False, True):
                perm = layout_indices(s, n, ht)
                assert sorted(perm.tolist()) == list(range(s))
                lengths = [local_length(s, n, r, ht) for r in range(n)]
                assert max(lengths) - min(lengths) <= (2 if ht else 1) and min(lengths) >= 1
                if s % (2 * n) == 0:  # agrees with torch.chunk / torch's head-tail layout
                    chunks = torch.arange(s).chunk(2 * n if ht else n)
                    for r in range(n):
                        want = torch.cat([chunks[r], chunks[2 * n - 1 - r]]) if ht else chunks[r]
                        assert torch.equal(shard_positions(s, n, r, ht), want)


def _check_any_length() -> int:
    n = dist.get_world_size()
    count = 0
    for s in (n, n + 1, 2 * n + 1, 5 * n + 3):
        for i, (causal, lb) in enumerate(((True, True), (True, False), (False, True),
                                          (False, False))):
            check_ring(s, causal=causal, lb=lb, rotate=ROTATIONS[(s + i) % 3], seed=s + i)
            count += 1
    for i, rotate in enumerate(ROTATIONS):
        for causal, lb in ((True, True), (False, False)):
            check_ring(1031, causal=causal, lb=lb, rotate=rotate, seed=i, d=4, hq=2, hkv=1)
            count += 1
    # documents and a window at the prime length
    check_ring(1031, causal=True, lb=True, rotate="p2p", seed=9, d=4,
               cu_seqlens=[0, 17, 400, 401, 1000, 1031], window=150)
    return count + 1


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_ring_any_length_matches_reference(ranks, world_size):
    counts = ranks(world_size).run(_check_any_length)
    assert counts == [16 + 6 + 1] * world_size


# ---------------------------------------------------------- opcheck, compile


def _check_opcheck_new_args() -> int:
    n = dist.get_world_size()
    s = 6 * n + 1
    q, k, v = (local(global_tensor((2, h, s, 8), torch.float64, i), s, True).requires_grad_(True)
               for i, h in enumerate((4, 2, 2)))
    cu = torch.tensor([0, 3, s - 2, s])
    for extras in ((cu, [2, 1], s), (None, None, s), (cu, None, s), (None, [1, 0], s)):
        args = (dist.group.WORLD.group_name, True, "head_tail", None, "auto", "p2p", *extras)
        torch.library.opcheck(ops.ring_sdpa.default, (q, k, v, *args))
        with torch.no_grad():
            out, lse = ops.ring_sdpa(q, k, v, *args)
        torch.library.opcheck(ops.ring_sdpa_backward.default,
                              (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out,
                               lse, *args))
    return 4


@pytest.mark.parametrize("world_size", [1, 2])
def test_ring_new_args_opcheck(ranks, world_size):
    assert ranks(world_size).run(_check_opcheck_new_args) == [4] * world_size


def _attend(q, k, v, cu, group_name, s):
    out, lse = cplib.ring_sdpa(q, k, v, group_name, is_causal=True, load_balanced=True,
                               cu_seqlens=cu, window=(5, None), seq_len=s)
    return out * 2.0, lse


def _check_compile() -> int:
    torch._dynamo.reset()
    n = dist.get_world_size()
    s = 12 * n + 3
    cu = torch.tensor([0, 4, 20, s])
    compiled = torch.compile(_attend, backend="aot_eager", fullgraph=True)
    results = []
    for fn in (_attend, compiled):
        q, k, v = (local(global_tensor((1, h, s, 8), torch.float32, 3 + i), s, True)
                   .requires_grad_(True) for i, h in enumerate((4, 2, 2)))
        out, lse = fn(q, k, v, cu, dist.group.WORLD.group_name, s)
        out.backward(torch.ones_like(out))
        results.append((out.detach(), lse, q.grad, k.grad, v.grad))
    for name, e, c in zip(("out", "lse", "dq", "dk", "dv"), *results):
        torch.testing.assert_close(c, e, atol=0, rtol=0, msg=lambda m: f"compiled {name}: {m}")
    return 1


@pytest.mark.parametrize("world_size", [2])
def test_ring_documents_window_compile_fullgraph(ranks, world_size):
    assert ranks(world_size).run(_check_compile) == [1] * world_size


# ---------------------------------------------------------------- bad input


def _check_bad_lengths() -> int:
    n = dist.get_world_size()
    g = dist.group.WORLD
    q = torch.randn(1, 2, 1, 4)
    with pytest.raises(ValueError, match=f"seq_len={n - 1} is shorter than the world size {n}"):
        cplib.ring_sdpa(q, q, q, g, seq_len=n - 1)
    with pytest.raises(ValueError, match=f"seq_len={n - 1} is shorter than the world size {n}"):
        ops.ring_sdpa(q, q, q, g.group_name, seq_len=n - 1)
    s = 4 * n + 1  # rank 0 holds 5 rows sequentially, the others 4
    wrong = torch.randn(1, 2, 6, 4)
    # Every rank's shard is wrong: every rank raises the same error, the first rank's.
    with pytest.raises(ValueError, match=f"invalid input on every rank .*seq_len={s} over {n} "
                                         "ranks .* gives rank 0 "):
        cplib.ring_sdpa(wrong, wrong, wrong, g, seq_len=s)
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == n
    return 3


@pytest.mark.parametrize("world_size", [2])
def test_ring_any_length_bad_input(ranks, world_size):
    assert ranks(world_size).run(_check_bad_lengths) == [3] * world_size
