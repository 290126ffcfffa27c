"""strategy="auto" on ``_ContextParallel(seq_dim=2, AttentionType.FLEX)``
(gloo, CPU): the flex ring and the flex all-gather as candidates priced from
the flex plan. The predicted bytes each rank receives equal the bytes that
crossed the process group into it (counted at torch's collectives,
tests/support/wire_count.py, not from the plan) and a count made from the
dense mask alone, for causal, window and documents masks at N=2 and 4,
forward and forward+backward; the choice is
one on every rank (measured calibrations differ per rank), made once per
plan and logged once, its outputs and gradients equal single-process
flex_attention, ``explain`` lists both candidates; a memory limit between
the two predictions picks the ring, one below both raises the same
ValueError on every rank; an explicit rotation wins (no choice made); a
compiled model (fullgraph) keeps the choice out of its graph (the ring)."""

from __future__ import annotations

import unittest
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import parallelize_module
from torch.nn.attention.flex_attention import create_block_mask

import cplib
from cplib import _context_parallel_shard
from cplib.flex import plan as flex_plan
from cplib.flex.ring_ops import ring_bytes_received
from cplib.strategy import choice as choice_mod
from cplib.strategy.calibration import default_for
from cplib.strategy.candidates import Candidate
from cplib.strategy.cost import predict
from cplib.strategy.flex_route import _workload, flex_stats
from flex_cases import (Model, balancer, causal, cpu_flex_grads, document_causal,
                        document_lengths, flex_reference, mesh, randn, rotate, sliding_window)
from harness import assert_close
from wire_count import counting_wire

DIM = 8
TOL = dict(atol=2e-6, rtol=1e-5)  # fp32 CP against float64 truth (test_flex_ring.py)
CPU = cplib.AutoStrategy(calibration="cpu")
RING, GATHER = Candidate("flex", "p2p", 1, "sequential"), Candidate("flex", "allgather", 1,
                                                                      "sequential")


def _mask_mod(kind: str, S: int):
    if kind == "causal":
        return causal, None
    if kind == "window":
        return sliding_window(S // 8), None
    lengths = document_lengths(1, S, 5, 1, seed=S)
    return document_causal(lengths), lengths


def _case(kind: str, S: int, block: int, lb_kind: str, heads=(2, 2)):
    """Global q, k, v, cotangent, the full mask, the balancer and the shards."""
    mask_mod, lengths = _mask_mod(kind, S)
    hq, hkv = heads
    q, k, v = randn((1, hq, S, DIM), 1), randn((1, hkv, S, DIM), 2), randn((1, hkv, S, DIM), 3)
    cot = randn((1, hq, S, DIM), 4)
    full = create_block_mask(mask_mod, 1, 1, S, S, device="cpu", BLOCK_SIZE=block)
    lb = balancer(lb_kind, S, full, lengths)
    with torch.compiler.set_stance("force_eager"):
        local = _context_parallel_shard(mesh(), [q, k, v, cot, full], [2] * 4 + [0], lb)
    return (q, k, v, cot, full, lb), local


def _style(strategy) -> cplib._ContextParallel:
    return cplib._ContextParallel(seq_dim=2,
                                  attention_type=cplib._ContextParallel.AttentionType.FLEX,
                                  strategy=strategy)


def _model(strategy, style: cplib._ContextParallel | None = None) -> torch.nn.Module:
    return parallelize_module(Model(), mesh(), {"attn": style or _style(strategy)})


def _needed_blocks(kind: str, S: int, block: int, lb_kind: str) -> torch.Tensor:
    """``(N, N)``: how many key blocks of rank j rank i's queries see, from
    the dense mask on the original positions and the balancer's permutation
    alone (no BlockMask, no plan). The flex ring moves whole key blocks."""
    n = dist.get_world_size()
    mask_mod, lengths = _mask_mod(kind, S)
    lb = balancer(lb_kind, S, None, lengths)
    order = torch.arange(S) if lb is None else lb._generate_indices()[0]
    pos = torch.arange(S)
    dense = mask_mod(0, 0, pos[:, None], pos[None, :])[order][:, order]  # rearranged rows/keys
    per_rank = S // n
    sees = dense.view(n, per_rank, S // block, block).any(-1).any(1)  # (N, key blocks)
    return sees.view(n, n, per_rank // block).sum(-1)


def _check_bytes(cases) -> list[tuple[float, int]]:
    """Per case: the predicted bytes this rank receives equal those that
    crossed the group into it and the dense mask's count, after the forward
    (the key blocks our queries see, K and V), and for documents (the least
    regular plan) after the backward too (those K/V rows again, and dK|dV of
    our blocks that other ranks saw)."""
    got = []
    group = mesh().get_group().group_name
    rank = dist.get_rank()
    with cpu_flex_grads(), rotate("p2p"):
        ring = _model(None)  # the flex ring, without a strategy
        for kind, S, block, lb_kind in cases:
            _, (q, k, v, cot, mask) = _case(kind, S, block, lb_kind)
            stats = flex_stats(getattr(mask, flex_plan.SHARD_ATTR), mask, q, group)
            lq, lk, lv = (t.clone().requires_grad_(True) for t in (q, k, v))
            w = _workload(stats, lq, lk, lv, CPU)
            need = _needed_blocks(kind, S, block, lb_kind)
            kv_block = 2 * block * lk.shape[1] * DIM * lk.element_size()  # K and V rows
            others = [j for j in range(need.shape[0]) if j != rank]
            fetched = sum(int(need[rank, j]) for j in others) * kv_block
            returned = sum(int(need[j, rank]) for j in others) * kv_block
            with counting_wire() as wire:
                out = ring(lq, lk, lv, block_mask=mask)
                counts = [(False, wire.received, fetched)]
                if kind == "documents":  # the backward's traffic too (flex's CPU backward is slow)
                    out.backward(cot)
                    counts.append((True, wire.received, 2 * fetched + returned))
            for backward, crossed, dense in counts:
                want = predict(RING, replace(w, backward=backward),
                               default_for("cpu")).received[rank]
                assert crossed == want == dense, (kind, lb_kind, backward, crossed, want, dense)
                got.append((want, crossed))
    return got


BYTES_CASES = [("causal", 256, 32, "none"), ("window", 256, 32, "none"),
               ("documents", 256, 32, "head_tail")]


@pytest.mark.parametrize("world", [2, 4])
def test_predicted_bytes_equal_the_bytes_that_crossed(ranks, world):
    per_rank = ranks(world).run(_check_bytes, BYTES_CASES)
    # Something travelled on some rank in every case (the check is not 0 == 0).
    for i in range(len(BYTES_CASES) + 1):
        assert any(rank[i][1] > 0 for rank in per_rank), i


def _check_auto_matches_flex() -> tuple[str, str, int]:
    """strategy="auto" (measured calibration, different on each rank): two
    calls on one mask, one choice logged, results equal flex_attention (at
    this size the fixed costs make it the all-gather; the ring's results
    under auto are checked in _check_memory_limit)."""
    (q, k, v, cot, full, lb), (lq, lk, lv, lcot, mask) = _case("window", 256, 32, "none")
    style = cplib._ContextParallel(
        seq_dim=2, attention_type=cplib._ContextParallel.AttentionType.FLEX, strategy="auto")
    model = parallelize_module(Model(), mesh(), {"attn": style})
    try:
        # assertLogs: captures the cplib logger at INFO, restored on exit.
        with cpu_flex_grads(), unittest.TestCase().assertLogs("cplib", "INFO") as logs:
            ref = flex_reference(q, k, v, full, None, False, cot, torch.zeros(q.shape[:3]))
            want = cplib.shard(mesh(), [ref[0], ref[2], ref[3], ref[4]], [2] * 4, lb)
            for _ in range(2):
                a, b, c = (t.clone().requires_grad_(True) for t in (lq, lk, lv))
                out = model(a, b, c, block_mask=mask)
                out.backward(lcot)
                for name, g, e in zip(("out", "dq", "dk", "dv"),
                                      (out, a.grad, b.grad, c.grad), want):
                    assert_close(g.detach().double(), e.double(), what=f"auto {name}", **TOL)
        choices = cplib.explain(style)
        messages = [r.getMessage() for r in logs.records]
        chosen = [m for m in messages if m.startswith("cplib.strategy: flex ")]
        assert len(choices) == 1 and len(chosen) == 1, (messages, choices)
        table = str(choices[0])
        assert "flex p2p" in table and "flex allgather" in table and "| * |" in table, table
        return choices[0].chosen.name, chosen[0].split(" for ")[0], len(choices[0].rows)
    finally:
        choice_mod.clear_caches()


def test_auto_on_flex_matches_flex_attention_and_agrees(ranks):
    per_rank = ranks(2).run(_check_auto_matches_flex)
    assert len(set(per_rank)) == 1, per_rank  # one choice, one log line, on every rank
    assert per_rank[0][2] == 2


def _predicted_peaks(kind: str) -> dict[str, float]:
    _, (q, k, v, _, mask) = _case(kind, 256, 32, "none")
    shard = getattr(mask, flex_plan.SHARD_ATTR)
    stats = flex_stats(shard, mask, q, mesh().get_group().group_name)
    w = _workload(stats, *(t.clone().requires_grad_(True) for t in (q, k, v)), CPU)
    return {c.rotate: predict(c, w, default_for("cpu")).memory_bytes for c in (RING, GATHER)}


def _check_memory_limit() -> tuple[str, str]:
    """A limit between the two predicted peaks picks the ring (which runs,
    exchanges on every rank and is exact); one below both raises before any
    exchange."""
    peaks = _predicted_peaks("causal")
    assert peaks["p2p"] < peaks["allgather"], peaks
    (q, k, v, cot, full, lb), (lq, lk, lv, lcot, mask) = _case("causal", 256, 32, "none")
    between = cplib.AutoStrategy(calibration="cpu", margin=0.0,
                                 memory_limit=int((peaks["p2p"] + peaks["allgather"]) / 2))
    try:
        with cpu_flex_grads():
            ref = flex_reference(q, k, v, full, None, False, cot, torch.zeros(q.shape[:3]))
            want = cplib.shard(mesh(), [ref[0], ref[2], ref[3], ref[4]], [2] * 4, lb)
            a, b, c = (t.clone().requires_grad_(True) for t in (lq, lk, lv))
            style = _style(between)
            with counting_wire() as wire:
                out = _model(None, style)(a, b, c, block_mask=mask)
                out.backward(lcot)
            for name, g, e in zip(("out", "dq", "dk", "dv"), (out, a.grad, b.grad, c.grad),
                                  want):
                assert_close(g.detach().double(), e.double(), what=f"limit: {name}", **TOL)
            # Causal over 2 ranks: rank 0 sends its K/V and gets their dK|dV back,
            # rank 1 the other way round. No rank is excused.
            assert [c.chosen for c in cplib.explain(style)] == [RING], cplib.explain(style)
            assert wire.sent > 0 and wire.received > 0, (wire.sent, wire.received)
            below = cplib.AutoStrategy(calibration="cpu", memory_limit=int(peaks["p2p"] / 2))
            with pytest.raises(ValueError) as info:
                _model(below)(lq, lk, lv, block_mask=mask)
        return str(info.value), "ok"
    finally:
        choice_mod.clear_caches()


def test_memory_limit_picks_the_ring_or_raises_on_every_rank(ranks):
    per_rank = ranks(2).run(_check_memory_limit)
    assert len(set(per_rank)) == 1, per_rank
    assert "memory_limit=" in per_rank[0][0] and "flex p2p" in per_rank[0][0], per_rank


def _check_explicit_rotation() -> list[int]:
    """set_rotate_method("allgather") before parallelizing, or
    AutoStrategy(rotate="p2p"): that path runs and no choice is made."""
    _, (q, k, v, _, mask) = _case("window", 256, 32, "none")
    received = []
    try:
        with rotate("allgather"):
            style = cplib._ContextParallel(
                seq_dim=2, attention_type=cplib._ContextParallel.AttentionType.FLEX,
                strategy=CPU)
            model = parallelize_module(Model(), mesh(), {"attn": style})
            ring_bytes_received(reset=True)
            model(q, k, v, block_mask=mask)
            received.append(ring_bytes_received(reset=True))
            assert cplib.explain(style) == []
        pinned = cplib._ContextParallel(
            seq_dim=2, attention_type=cplib._ContextParallel.AttentionType.FLEX,
            strategy=cplib.AutoStrategy(calibration="cpu", rotate="p2p"))
        parallelize_module(Model(), mesh(), {"attn": pinned})(q, k, v, block_mask=mask)
        received.append(ring_bytes_received(reset=True))
        assert cplib.explain(pinned) == []
        return received
    finally:
        choice_mod.clear_caches()


def test_explicit_rotation_wins(ranks):
    per_rank = ranks(2).run(_check_explicit_rotation)
    assert all(r[0] == 0 for r in per_rank), per_rank  # the all-gather: no ring bytes
    assert per_rank[1][1] > 0, per_rank  # the ring: rank 1 visits rank 0's window


def _check_compiled() -> int:
    """A compiled model (fullgraph) with strategy="auto": the choice stays
    out of the graph (the ring runs), the output is flex_attention's."""
    (q, k, v, cot, full, lb), (lq, lk, lv, _, mask) = _case("causal", 256, 32, "head_tail")
    model = torch.compile(_model(CPU), backend="aot_eager", fullgraph=True)
    try:
        with cpu_flex_grads():
            ref = flex_reference(q, k, v, full, None, False, cot, torch.zeros(q.shape[:3]))
            ring_bytes_received(reset=True)
            out = model(lq, lk, lv, block_mask=mask)
        (want,) = cplib.shard(mesh(), [ref[0]], [2], lb)
        assert_close(out.double(), want.double(), what="compiled auto: out", **TOL)
        return ring_bytes_received(reset=True)
    finally:
        choice_mod.clear_caches()


def test_compiled_auto_runs_the_ring(ranks):
    assert all(b > 0 for b in ranks(2).run(_check_compiled))
