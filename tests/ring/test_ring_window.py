"""ring_sdpa with sliding windows against full attention with an explicit
window mask in one process (fp64: out, lse, dq, dk, dv) at world sizes 1, 2,
4: windows 0, 1, S/8, S/N-1, S/N, S/N+1 and S, causal and not, both layouts,
every rotation, asymmetric windows. The traffic shrinks with the window
(p2p and alltoall exchange only the rows in reach); a negative window
raises ValueError on every rank before any communication."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import cplib
from cplib.comm.native import ops
from cplib.attention.layout import shard_positions
from ring_mask_cases import check_ring, visible

ROTATIONS = ["p2p", "alltoall", "allgather"]


def _windows(s: int, n: int) -> list[int]:
    return sorted({0, 1, s // 8, s // n - 1, s // n, s // n + 1, s})


def _check_windows() -> int:
    n = dist.get_world_size()
    count = 0
    for s in (16 * n, 16 * n + 5):
        for i, w in enumerate(_windows(s, n)):
            for j, (causal, lb) in enumerate(((True, True), (True, False), (False, True),
                                               (False, False))):
                rotate = ROTATIONS[(i + j) % 3]
                check_ring(s, causal=causal, lb=lb, rotate=rotate, window=w, seed=i + 10 * j,
                           hq=2, hkv=1 if j % 2 else 2)
                count += 1
    # asymmetric and one-sided windows
    for k, window in enumerate(((2, 9), (0, 5), (7, 0), (None, 3), (4, None))):
        check_ring(16 * n + 3, causal=False, lb=k % 2 == 0, rotate=ROTATIONS[k % 3],
                   window=window, seed=50 + k)
        count += 1
    # without seq_len (even shards): the global length is inferred
    check_ring(16 * n, causal=True, lb=True, rotate="p2p", window=3, seq_len_arg=False, seed=60)
    # a long shard, several tiles per block
    check_ring(700 * n, causal=True, lb=False, rotate="p2p", window=300, seed=61, d=4, hq=1,
               hkv=1)
    return count + 2


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_ring_window_matches_masked_reference(ranks, world_size):
    counts = ranks(world_size).run(_check_windows)
    assert counts[0] > 50 and len(set(counts)) == 1


# ------------------------------------------------- traffic scales with W


def _sent_forward(s, lb, causal, window, rotate) -> int:
    rank, n = dist.get_rank(), dist.get_world_size()
    x = torch.randn(1, 1, s, 4, dtype=torch.float64)
    xl = x[:, :, shard_positions(s, n, rank, lb)].contiguous()
    dist.barrier()
    ops.ring_debug_bytes_sent(True)
    cplib.ring_sdpa(xl, xl, xl, dist.group.WORLD, is_causal=causal, load_balanced=lb,
                    window=window, seq_len=s, rotate=rotate)
    return ops.ring_debug_bytes_sent(True)


def _check_window_traffic() -> int:
    rank, n = dist.get_rank(), dist.get_world_size()
    s = 8 * n
    row = 2 * 4 * 8  # k and v, one head, d=4, float64
    checked = 0
    for lb, causal in ((False, True), (False, False), (True, True)):
        for rotate in ("p2p", "alltoall"):
            for w in (0, 1, 7, 8, 9, 20, s):
                sent = _sent_forward(s, lb, causal, w, rotate)
                mask = visible(s, causal=causal, window=w)
                mine = shard_positions(s, n, rank, lb)
                # only the rows some query of the receiver sees travel
                want = sum(row * int(mask[shard_positions(s, n, other, lb)][:, mine].any(0).sum())
                           for other in range(n) if other != rank)
                assert sent == want, (lb, causal, rotate, w, sent, want)
                checked += 1
    # sequential causal, window within one shard: the last 3 rows, to one neighbour only
    assert _sent_forward(s, False, True, 3, "p2p") == (row * 3 if rank < n - 1 else 0)
    return checked


@pytest.mark.parametrize("world_size", [4])
def test_ring_window_sends_only_rows_in_reach(ranks, world_size):
    assert ranks(world_size).run(_check_window_traffic) == [42] * world_size


def _check_bad_window() -> int:
    q = torch.randn(1, 2, 8, 4)
    g = dist.group.WORLD
    for window, match in ((-1, r"window=-1 must be non-negative"),
                          ((2, -3), r"window=\(2, -3\) must be non-negative"),
                          ((1, 2, 3), r"must be an int or \(left, right\)")):
        with pytest.raises(ValueError, match=match):
            cplib.ring_sdpa(q, q, q, g, window=window)
    with pytest.raises(ValueError, match=r"window=\[4, -2\] must be non-negative"):
        ops.ring_sdpa(q, q, q, g.group_name, window=[4, -2])
    with pytest.raises(ValueError, match=r"window must be \(left, right\), got \[4\]"):
        ops.ring_sdpa(q, q, q, g.group_name, window=[4])
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size()
    return 5


@pytest.mark.parametrize("world_size", [2])
def test_ring_window_bad_input(ranks, world_size):
    assert ranks(world_size).run(_check_bad_window) == [5] * world_size


def _threaded_body() -> int:
    n = dist.get_world_size()
    s = 8 * n + 3
    check_ring(s, causal=True, lb=False, rotate="p2p", window=5, seed=1)
    check_ring(s, causal=False, lb=True, rotate="alltoall", window=(2, 6), seed=2,
               cu_seqlens=[0, 4, 5, s])
    return 2


def test_ring_window_threaded_group(threaded):
    # torch's threaded group has no send/recv: the exchange is a split
    # all-to-all that every rank joins, with empty splits where nothing moves.
    assert threaded(4, _threaded_body) == [2] * 4
