"""A lightning indexer under context parallelism
(cplib/integrations/transformers/sparse/indexer.py): DeepSeek-V3.2's
indexer, scored on each rank's shard against the whole sequence, takes the
top-k one process takes over the whole sequence (the same key set per
query, except between scores equal within rounding), with padding, over 2
and 4 ranks, sequential and head-tail; and no rank holds more scores at once
than its queries times the sequence (one process holds heads x S x S)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from cplib.attention.layout import shard_positions
from cplib.sparse import RowLayout

S, B, TOPK, HEADS = 48, 2, 8, 4
TIE = 1e-5  # scores this close (relative) to the k-th are a tie: either may be taken


def _indexer():
    from transformers import DeepseekV32Config
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as m

    config = DeepseekV32Config(hidden_size=32, q_lora_rank=16, qk_rope_head_dim=4,
                               qk_nope_head_dim=4, index_n_heads=HEADS, index_head_dim=8,
                               index_topk=TOPK, num_attention_heads=4)
    torch.manual_seed(0)
    indexer = m.DeepseekV32Indexer(config, 0)
    g = torch.Generator().manual_seed(1)
    hidden, resid = torch.randn(B, S, 32, generator=g), torch.randn(B, S, 16, generator=g)
    pos = torch.arange(S).expand(B, S)
    cos, sin = m.DeepseekV32RotaryEmbedding(config)(hidden, pos)
    valid = torch.ones(B, S, dtype=torch.bool)
    valid[1, :5] = False  # left padding in one row
    return indexer, hidden, resid, (cos, sin), pos, valid


class _TopkInputs(TorchFunctionMode):
    """The scores each top-k is taken of."""

    def __init__(self):
        super().__init__()
        self.scores = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.topk:
            self.scores.append(args[0])
        return func(*args, **(kwargs or {}))


class _LargestScores(TorchDispatchMode):
    """The most float32 entries any one op's output with the sequence as its
    last dimension held (score blocks)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() and \
                    t.shape[-1] == S:
                self.largest = max(self.largest, t.numel())
        return out


def _one_process():
    indexer, hidden, resid, rope, pos, valid = _indexer()
    see = (torch.arange(S)[None, :] <= torch.arange(S)[:, None])[None] & valid[:, None, :]
    with _TopkInputs() as seen, _LargestScores() as peak:
        topk = indexer(hidden, resid, rope, see, pos)
    return topk, seen.scores[0], peak.largest


def _under_cp(head_tail: bool):
    import cplib.hf  # noqa: F401  (installs the integration: the indexer is wrapped)
    from cplib.integrations.transformers.sparse.call import SparseCall, close_call, open_call

    n, rank = dist.get_world_size(), dist.get_rank()
    indexer, hidden, resid, rope, pos, valid = _indexer()
    from cplib.integrations import transformers as integration
    integration.install(import_transformers=True)
    positions = tuple(shard_positions(S, n, r, head_tail) for r in range(n))
    rows = RowLayout(positions, rank, dist.group.WORLD.group_name, S)
    mine = positions[rank]

    class Layer:  # what the indexer's call reads of its layer
        pass

    layer = Layer()
    layer.indexer = indexer
    call = SparseCall(layer, "test", rows, mine, valid, None, None)
    token = open_call(call)
    try:
        with _LargestScores() as peak:
            topk = indexer(hidden[:, mine], resid[:, mine], tuple(r[:, mine] for r in rope),
                           None, pos[:, mine])
    finally:
        close_call(token)
    return mine, topk, peak.largest


def _check(head_tail: bool) -> tuple[int, int, int]:
    want, scores, one_process_peak = _one_process()
    mine, got, peak = _under_cp(head_tail)
    for b in range(B):
        for i, p in enumerate(mine.tolist()):
            row = scores[b, p]
            seeable = row > float("-inf")
            have = {k for k in got[b, i].tolist() if seeable[k]}
            need = {k for k in want[b, p].tolist() if seeable[k]}
            kth = row[want[b, p].long()].min()
            for k in have ^ need:  # only ties at the boundary may differ
                assert abs(row[k] - kth) <= TIE * (1 + abs(kth)), (b, p, k, have, need)
    return peak, mine.numel(), one_process_peak


@pytest.mark.parametrize("n", [2, 4])
def test_indexer_under_cp_takes_one_process_topk(ranks, n):
    for head_tail in (False, True):
        for peak, rows, one_process_peak in ranks(n).run(_check, head_tail):
            assert 0 < peak <= B * rows * S, (peak, rows)  # this rank's queries x S
            # One process: S x S per head, and the keys its matmul broadcasts (head_dim 8).
            assert one_process_peak == B * S * max(HEADS, 8) * S
