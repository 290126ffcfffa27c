"""Load balancers: exact indices against hand-worked layouts, and the
rearrange/restore round trip as a property."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.nn.attention.flex_attention import create_block_mask

from cplib.ring.load_balancer import (
    _HeadTailLoadBalancer,
    _LoadBalancer,
    _PerDocumentHeadTailLoadBalancer,
    _PTRRLoadBalancer,
    rearrange,
)


def _shards(x: torch.Tensor, seq_dim: int, lb: _LoadBalancer | None, n: int):
    if lb is not None:
        x = rearrange(x, seq_dim, lb._generate_indices())
    return list(x.chunk(n, seq_dim))


def _unshard(shards, seq_dim: int, lb: _LoadBalancer | None) -> torch.Tensor:
    full = torch.cat(shards, seq_dim)
    return full if lb is None else rearrange(full, seq_dim, lb._generate_indices(restore=True))


def test_head_tail_arange32_world2_exact():
    lb = _HeadTailLoadBalancer(32, 2, "cpu")
    idx = lb._generate_indices()
    assert idx.shape == (1, 32)
    r0 = list(range(0, 8)) + list(range(24, 32))
    r1 = list(range(8, 16)) + list(range(16, 24))
    assert idx[0].tolist() == r0 + r1
    s0, s1 = _shards(torch.arange(32), 0, lb, 2)
    assert s0.tolist() == r0 and s1.tolist() == r1
    # Expanded positions (stride 0 on the batch): every row is sharded alike.
    pos = torch.arange(32).expand(3, 32)
    p0, p1 = _shards(pos, 1, lb, 2)
    assert p0.tolist() == [r0] * 3 and p1.tolist() == [r1] * 3
    restore = lb._generate_indices(restore=True)
    assert torch.equal(idx[0][restore[0]], torch.arange(32))
    assert torch.equal(_unshard([p0, p1], 1, lb), pos)


def test_head_tail_world4_and_one():
    idx = _HeadTailLoadBalancer(16, 4, "cpu")._generate_indices()[0].tolist()
    assert idx == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
    assert _HeadTailLoadBalancer(6, 1, "cpu")._generate_indices()[0].tolist() == list(range(6))


def test_head_tail_rejects_indivisible_length():
    with pytest.raises(ValueError, match=r"\(30\).*2 \* world_size = 4"):
        _HeadTailLoadBalancer(30, 2, "cpu")._generate_indices()


def test_per_document_matches_hand_worked_layout():
    # torch's docstring example: documents of 4, 8 and 4 tokens on 2 ranks.
    lb = _PerDocumentHeadTailLoadBalancer([[4, 8, 4], [8, 8]], 2, "cpu")
    idx = lb._generate_indices()
    assert idx.shape == (2, 16)
    assert idx[0].tolist() == [0, 3, 4, 5, 10, 11, 12, 15, 1, 2, 6, 7, 8, 9, 13, 14]
    assert idx[1].tolist() == [0, 1, 6, 7, 8, 9, 14, 15, 2, 3, 4, 5, 10, 11, 12, 13]
    restore = lb._generate_indices(restore=True)
    for b in range(2):
        assert torch.equal(idx[b][restore[b]], torch.arange(16))
    # Per-row indices shard a (B, S, D) tensor row by row and restore it.
    x = torch.randn(2, 16, 3)
    shards = _shards(x, 1, lb, 2)
    assert torch.equal(shards[0][0, :, 0], x[0, idx[0, :8], 0])
    assert torch.equal(_unshard(shards, 1, lb), x)


def test_per_document_rejects_bad_lengths():
    with pytest.raises(ValueError, match=r"divisible by 2 \* world_size = 4.*\[4, 6\]"):
        _PerDocumentHeadTailLoadBalancer([[4, 6]], 2, "cpu")._generate_indices()
    with pytest.raises(ValueError, match="same sequence length"):
        _PerDocumentHeadTailLoadBalancer([[4, 4], [4]], 2, "cpu")._generate_indices()


def test_ptrr_scheduling_hand_worked():
    t = torch.tensor([9, 14, 2, 20, 10, 15, 8, 14, 16, 19, 15, 3, 12, 1, 12, 10])
    groups = _PTRRLoadBalancer.ptrr_scheduling(t, 4)
    assert groups.tolist() == [[3, 12, 13, 14], [2, 4, 7, 9], [1, 8, 11, 15], [0, 5, 6, 10]]
    assert [int(t[g].sum()) for g in groups] == [45, 45, 43, 47]
    with pytest.raises(NotImplementedError,
                       match=r"num_tasks 16 must be divisible by group_size 3"):
        _PTRRLoadBalancer.ptrr_scheduling(t, 3)


def _doc_block_mask(block: int):
    # Documents of 4, 8 and 4 blocks; causal inside each document.
    doc = torch.tensor([0] * 4 + [1] * 8 + [2] * 4).repeat_interleave(block)

    def mask(b, h, q, kv):
        return (doc[q] == doc[kv]) & (q >= kv)

    n = doc.numel()
    return create_block_mask(mask, 1, 1, n, n, device="cpu", BLOCK_SIZE=block)


def test_ptrr_indices_hand_worked():
    # Block costs 1,2,3,4 | 1..8 | 1,2,3,4; dealt in descending cost, snaking.
    block = 4
    lb = _PTRRLoadBalancer(_doc_block_mask(block), 2)
    idx = lb._generate_indices()
    assert idx.shape == (1, 16 * block)
    blocks = [2, 3, 5, 6, 8, 11, 12, 13, 0, 1, 4, 7, 9, 10, 14, 15]
    expected = torch.cat([torch.arange(b * block, (b + 1) * block) for b in blocks])
    assert torch.equal(idx[0], expected)
    restore = lb._generate_indices(restore=True)
    assert torch.equal(idx[0][restore[0]], torch.arange(16 * block))


@settings(max_examples=60, deadline=None)
@given(
    world=st.integers(1, 8),
    per_rank=st.integers(1, 6),
    ndim=st.integers(1, 4),
    seq_dim_pick=st.integers(0, 7),
    kind=st.sampled_from(["none", "head_tail", "per_doc"]),
    data=st.data(),
)
def test_shard_then_unshard_is_identity(world, per_rank, ndim, seq_dim_pick, kind, data):
    seq = world * per_rank * (2 if kind != "none" else 1)
    seq_dim = seq_dim_pick % (2 * ndim) - ndim  # negative and positive dims
    shape = [data.draw(st.integers(1, 3)) for _ in range(ndim)]
    shape[seq_dim] = seq
    x = torch.randn(shape)
    lb: _LoadBalancer | None = None
    if kind == "head_tail":
        lb = _HeadTailLoadBalancer(seq, world, "cpu")
    elif kind == "per_doc":
        unit = 2 * world
        cuts = data.draw(st.lists(st.integers(1, seq // unit), min_size=1, max_size=3))
        docs, left = [], seq // unit
        for c in cuts:
            if left == 0:
                break
            take = min(c, left)
            docs.append(take * unit)
            left -= take
        if left:
            docs.append(left * unit)
        batch_ok = (seq_dim % ndim) > 0
        rows = shape[0] if batch_ok else 1
        lb = _PerDocumentHeadTailLoadBalancer([docs] * rows, world, "cpu")
    shards = _shards(x, seq_dim, lb, world)
    assert len(shards) == world and all(s.shape[seq_dim] == seq // world for s in shards)
    assert torch.equal(_unshard(shards, seq_dim, lb), x)
