"""ring_sdpa with packed documents (cu_seqlens) against full attention with an
explicit document mask in one process (fp64: out, lse, dq, dk, dv), at world
sizes 1, 2, 4: random splits whose documents cross shard boundaries,
documents of length 1, one document, one document per token; causal and
not; both layouts; every rotation; GQA; combined with a window. Plus: a rank
receives only the rows of a block it reads, and bad cu_seqlens raise
ValueError on every rank before any communication."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

import cplib
from cplib.comm.native import ops
from cplib.attention.layout import shard_positions
from ring_mask_cases import check_ring, random_documents, visible

ROTATIONS = ["p2p", "alltoall", "allgather"]


def _document_sets(s: int, gen: torch.Generator) -> list[list[int]]:
    return [
        random_documents(s, gen, 3),          # few, long: they cross shard boundaries
        random_documents(s, gen, s // 3),     # many, some of length 1
        [0, s],                               # one document
        list(range(s + 1)),                   # one document per token
        [0, 1, s - 1, s],                     # length-1 documents at both ends
    ]


def _check_documents() -> int:
    n = dist.get_world_size()
    gen = torch.Generator().manual_seed(5 + n)
    count = 0
    for s in (8 * n, 8 * n + 3):  # divisible and not
        docs = _document_sets(s, gen)
        for i, (cu, causal, lb, rotate) in enumerate(
                itertools.product(docs, (True, False), (True, False), ROTATIONS)):
            # every rotation meets every document set; the rest rotate through
            if rotate != ROTATIONS[i % 3] and cu is not docs[0]:
                continue
            check_ring(s, causal=causal, lb=lb, rotate=rotate, cu_seqlens=cu, seed=i,
                       hq=2 if i % 2 else 4, hkv=1 if i % 2 else 2)
            count += 1
    # documents and a window together, and one larger shard (several tiles)
    check_ring(12 * n + 1, causal=True, lb=True, rotate="p2p",
               cu_seqlens=random_documents(12 * n + 1, gen, 4), window=5, seed=71)
    check_ring(12 * n + 1, causal=False, lb=False, rotate="alltoall",
               cu_seqlens=random_documents(12 * n + 1, gen, 4), window=(3, 7), seed=72)
    s = 300 * n + 7
    check_ring(s, causal=True, lb=True, rotate="p2p", cu_seqlens=random_documents(s, gen, 5),
               seed=73, d=4, hq=1, hkv=1)
    # per-document head-tail layout: every document cut across all ranks
    for j, (causal, rotate) in enumerate(itertools.product((True, False), ROTATIONS)):
        s = 10 * n + j
        docs = random_documents(s, gen, 3 + j % 3) if j != 4 else [0, 1, 2, s]
        check_ring(s, causal=causal, lb=True, rotate=rotate, cu_seqlens=docs,
                   per_document=True, window=None if j % 2 else 4, seed=80 + j)
    return count + 3 + 6


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_ring_documents_match_masked_reference(ranks, world_size):
    counts = ranks(world_size).run(_check_documents)
    assert counts[0] > 20 and len(set(counts)) == 1


# ------------------------------------------------- traffic: only the rows in use


def _expected_bytes(s: int, lb: bool, mask: torch.Tensor, block_bytes_per_row: int) -> int:
    """What this rank must send in the forward: to every other rank, the
    rows of its block that some query of that rank sees."""
    rank, n = dist.get_rank(), dist.get_world_size()
    mine = shard_positions(s, n, rank, lb)
    total = 0
    for other in range(n):
        if other == rank:
            continue
        rows = shard_positions(s, n, other, lb)
        total += block_bytes_per_row * int(mask[rows][:, mine].any(0).sum())
    return total


def _check_document_traffic() -> int:
    n = dist.get_world_size()
    checked = 0
    for s, lb, causal in ((16 * n, False, True), (16 * n + 5, True, True), (16 * n, False, False)):
        cu = [0] + [round(s * (i + 1) / (2 * n)) for i in range(2 * n - 1)] + [s]
        b, h, d = 1, 2, 8
        q = torch.randn(b, h, s, d, dtype=torch.float64)
        pos = shard_positions(s, n, dist.get_rank(), lb)
        ql = q[:, :, pos].contiguous()
        dist.barrier()
        ops.ring_debug_bytes_sent(True)
        cplib.ring_sdpa(ql, ql, ql, dist.group.WORLD, is_causal=causal, load_balanced=lb,
                        cu_seqlens=torch.tensor(cu), seq_len=s, rotate="p2p")
        sent = ops.ring_debug_bytes_sent(True)
        mask = visible(s, causal=causal, cu_seqlens=cu)
        want = _expected_bytes(s, lb, mask, 2 * b * h * d * 8)
        assert sent == want, (s, lb, causal, sent, want)
        checked += 1
    return checked


@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_documents_send_only_rows_in_use(ranks, world_size):
    assert ranks(world_size).run(_check_document_traffic) == [3] * world_size


# ---------------------------------------------------------------- bad input


def _check_bad_documents() -> int:
    n = dist.get_world_size()
    s = 8 * n
    q = torch.randn(1, 2, 8, 4)
    g = dist.group.WORLD
    bad = [
        (torch.tensor([0, 5, 3, s]), "strictly increasing, got 5 then 3 at index 2"),
        (torch.tensor([0, 4, 4, s]), "strictly increasing, got 4 then 4"),
        (torch.tensor([1, 4, s]), "must start at 0, got 1"),
        (torch.tensor([0, 4, s - 1]), f"must end at the sequence length {s}, got {s - 1}"),
        (torch.tensor([0.0, 4.0, float(s)]), "integer tensor, got dtype (torch.float32|Float)"),
        (torch.tensor([[0, s]]), "1-D with at least 2 entries"),
        (torch.tensor([0]), "1-D with at least 2 entries"),
    ]
    for cu, match in bad:
        with pytest.raises(ValueError, match=match):
            cplib.ring_sdpa(q, q, q, g, is_causal=True, cu_seqlens=cu)
        # the raw op (C++ checks) raises the same
        with pytest.raises(ValueError, match=match):
            ops.ring_sdpa(q, q, q, g.group_name, True, cu_seqlens=cu)
    with pytest.raises(ValueError, match="per_document=True .* needs cu_seqlens and seq_len"):
        cplib.ring_sdpa(q, q, q, g, cu_seqlens=torch.tensor([0, s]), per_document=True)
    t = torch.ones(1)
    dist.all_reduce(t)  # nobody communicated before raising: the group still works
    assert t.item() == n
    return len(bad)


@pytest.mark.parametrize("world_size", [2])
def test_ring_documents_bad_input(ranks, world_size):
    assert ranks(world_size).run(_check_bad_documents) == [7] * world_size


def _check_documents_differ_between_ranks() -> list[str]:
    rank, n = dist.get_rank(), dist.get_world_size()
    s = 8 * n + 1  # uneven shards: in check mode they must not count as a mismatch
    from cplib.attention.layout import local_length
    q = torch.randn(1, 2, local_length(s, n, rank, True), 4)
    g = dist.group.WORLD
    same = torch.tensor([0, 3, s])
    differs = torch.tensor([0, 3 + (rank == 1), s])
    with cplib.consistency_checks():
        out, _ = cplib.ring_sdpa(q, q, q, g, is_causal=True, load_balanced=True, cu_seqlens=same,
                                 seq_len=s, window=4)
        assert out.shape == q.shape
        try:
            cplib.ring_sdpa(q, q, q, g, is_causal=True, load_balanced=True, cu_seqlens=differs,
                            seq_len=s)
        except ValueError as exc:
            return [str(exc)]
    return ["no error"]


@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_documents_differing_between_ranks_check_mode(ranks, world_size):
    results = ranks(world_size).run(_check_documents_differ_between_ranks)
    assert all(r == results[0] for r in results), results
    assert "ranks disagree on cu_seqlens (hash of its values)" in results[0][0], results[0]
