"""cplib.sparse's attention over selected keys and its selection helpers
(cplib/sparse/attention.py, selection.py), in one process against the dense
computation in float64: masked attention with MLA head dims (v narrower
than q/k), GQA, sinks and rows that see no key; the indexer's query blocks
within this rank's queries times the sequence; the keys attended from a
top-k selection in global positions (head-tail rows, padding, documents)."""

from __future__ import annotations

import pytest
import torch

from cplib.attention.layout import shard_positions
from cplib.sparse import attended, masked_attention, query_block, visible
from harness import assert_close

TOL = dict(atol=1e-10, rtol=1e-10)


def _dense(q, k, v, mask, scale, sinks):
    """HF's eager attention with a boolean mask and sinks, float64."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    alive = mask.any(-1)[:, None, :, None]
    # A row that sees nothing gives zeros (its logits kept finite: no NaN).
    s = s.masked_fill(~mask[:, None] & alive, float("-inf"))
    if sinks is not None:
        s = torch.cat([s.masked_fill(~alive, float("-inf")),
                       sinks.view(1, -1, 1, 1).expand(*s.shape[:3], 1)], -1)
        return torch.softmax(s, -1)[..., :-1] @ v
    return (torch.softmax(s, -1) * alive) @ v


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_masked_attention_is_dense_attention(sinks, kv_heads):
    g = torch.Generator().manual_seed(kv_heads + 2 * sinks)
    b, h, lq, u, d, dv = 2, 4, 9, 13, 12, 8  # MLA: v narrower than q/k
    q = torch.randn(b, h, lq, d, dtype=torch.float64, generator=g)
    k = torch.randn(b, kv_heads, u, d, dtype=torch.float64, generator=g)
    v = torch.randn(b, kv_heads, u, dv, dtype=torch.float64, generator=g)
    sink = torch.randn(h, dtype=torch.float64, generator=g) if sinks else None
    mask = torch.rand(b, lq, u, generator=g) < 0.4
    mask[0, 3] = False  # a row that sees no key
    leaves = [t.clone().requires_grad_() for t in (q, k, v) + ((sink,) if sinks else ())]
    refs = [t.detach().clone().requires_grad_() for t in leaves]
    got = masked_attention(*leaves[:3], mask, 0.3, leaves[3] if sinks else None)
    want = _dense(*refs[:3], mask, 0.3, refs[3] if sinks else None)
    cot = torch.randn(want.shape, dtype=torch.float64, generator=g)
    (got * cot).sum().backward()
    (want * cot).sum().backward()
    assert_close(got, want, what="out", **TOL)
    for i, (mine, ref) in enumerate(zip(leaves, refs)):
        assert_close(mine.grad, ref.grad, what=f"grad {i}", **TOL)


def test_masked_attention_in_blocks_is_one_block(monkeypatch):
    """Queries split into blocks (to bound the logits held) give the same
    result and gradients as one block."""
    import cplib.sparse.attention as attention

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 10, 4, dtype=torch.float64, generator=g) for _ in range(3))
    mask = torch.rand(1, 10, 10, generator=g) < 0.5
    outs = []
    for budget in (1 << 24, 2 * 10 * 3):  # one block; blocks of 3 rows
        monkeypatch.setattr(attention, "_BLOCK_LOGITS", budget)
        leaf = q.clone().requires_grad_()
        out = masked_attention(leaf, k, v, mask, 0.5)
        out.sum().backward()
        outs.append((out.detach(), leaf.grad))
    assert_close(outs[1][0], outs[0][0], what="out", **TOL)
    assert_close(outs[1][1], outs[0][1], what="dq", **TOL)


def test_query_block_keeps_scores_within_the_ranks_share():
    for rows, width in ((4096, 128), (100, 3), (5, 64), (1, 1)):
        block = query_block(rows, width)
        assert block >= 1
        assert block * width <= max(rows, width)  # block x width x S <= rows x S


@pytest.mark.parametrize("head_tail", [False, True])
def test_attended_keys_are_the_visible_selection(head_tail):
    s, n, rank, k = 24, 2, 1, 5
    q_pos = shard_positions(s, n, rank, head_tail)
    g = torch.Generator().manual_seed(int(head_tail))
    topk = torch.randint(0, s, (2, q_pos.numel(), k), generator=g)
    topk[0, 0, 0] = -1  # an empty slot
    key_valid = torch.rand(2, s, generator=g) < 0.8
    cu = torch.tensor([0, 10, s])
    keys, mask = attended(topk, q_pos, key_valid, cu)
    see = visible(q_pos, torch.arange(s), key_valid, cu)
    want = torch.zeros(2, q_pos.numel(), s, dtype=torch.bool)
    want.scatter_(2, topk.clamp(min=0), True)
    want[0, 0, topk[0, 0, 0].clamp(min=0)] = bool((topk[0, 0, 1:] == 0).any())
    want &= see
    assert torch.equal(keys, want.any(0).any(0).nonzero().flatten())
    assert torch.equal(mask, want[..., keys])
