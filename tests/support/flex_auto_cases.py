"""What the tests of ``strategy="auto"`` on FLEX modules share (the routing,
tests/flex/test_flex_strategy.py; the model's bytes,
tests/strategy/test_strategy_flex.py): a masked case sharded by a load
balancer, the style and the model, the two candidates."""

from __future__ import annotations

import torch
from torch.distributed.tensor.parallel import parallelize_module
from torch.nn.attention.flex_attention import create_block_mask

import cplib
from cplib import _context_parallel_shard
from cplib.strategy.candidates import Candidate
from flex_cases import (Model, balancer, causal, document_causal, document_lengths, mesh, randn,
                        sliding_window)

DIM = 8
TOL = dict(atol=2e-6, rtol=1e-5)  # fp32 CP against float64 truth (test_flex_ring.py)
CPU = cplib.AutoStrategy(calibration="cpu")
RING, GATHER = Candidate("flex", "p2p", 1, "sequential"), Candidate("flex", "allgather", 1,
                                                                      "sequential")


def mask_mod_of(kind: str, S: int):
    if kind == "causal":
        return causal, None
    if kind == "window":
        return sliding_window(S // 8), None
    lengths = document_lengths(1, S, 5, 1, seed=S)
    return document_causal(lengths), lengths


def flex_case(kind: str, S: int, block: int, lb_kind: str, heads=(2, 2)):
    """Global q, k, v, cotangent, the full mask, the balancer and the shards."""
    mask_mod, lengths = mask_mod_of(kind, S)
    hq, hkv = heads
    q, k, v = randn((1, hq, S, DIM), 1), randn((1, hkv, S, DIM), 2), randn((1, hkv, S, DIM), 3)
    cot = randn((1, hq, S, DIM), 4)
    full = create_block_mask(mask_mod, 1, 1, S, S, device="cpu", BLOCK_SIZE=block)
    lb = balancer(lb_kind, S, full, lengths)
    with torch.compiler.set_stance("force_eager"):
        local = _context_parallel_shard(mesh(), [q, k, v, cot, full], [2] * 4 + [0], lb)
    return (q, k, v, cot, full, lb), local


def flex_style(strategy) -> cplib._ContextParallel:
    return cplib._ContextParallel(seq_dim=2,
                                  attention_type=cplib._ContextParallel.AttentionType.FLEX,
                                  strategy=strategy)


def flex_model(strategy, style: cplib._ContextParallel | None = None) -> torch.nn.Module:
    return parallelize_module(Model(), mesh(), {"attn": style or flex_style(strategy)})
