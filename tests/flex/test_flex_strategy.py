"""strategy="auto" on ``_ContextParallel(seq_dim=2, AttentionType.FLEX)``
(gloo, CPU; cplib/flex/strategy_route.py): the choice between the flex ring
and the flex all-gather is one on every rank (measured calibrations differ
per rank), made once per plan and logged once, its outputs and gradients
equal single-process flex_attention, ``explain`` lists both candidates; a
memory limit between the two predictions picks the ring, one below both
raises the same ValueError on every rank; an explicit rotation wins (no
choice made); a compiled model (fullgraph) keeps the choice out of its graph
(the ring). The model's bytes: tests/strategy/test_strategy_flex.py."""

from __future__ import annotations

import unittest

import pytest
import torch
from torch.distributed.tensor.parallel import parallelize_module

import cplib
from cplib.flex import plan as flex_plan
from cplib.flex.ring_ops import ring_bytes_received
from cplib.flex.strategy_route import _workload, flex_stats
from cplib.strategy import choice as choice_mod
from cplib.strategy.calibration import default_for
from cplib.strategy.cost import predict
from flex_auto_cases import CPU, GATHER, RING, TOL, flex_case, flex_model, flex_style
from flex_cases import Model, cpu_flex_grads, flex_reference, mesh, rotate
from harness import assert_close
from wire_count import counting_wire


def _check_auto_matches_flex() -> tuple[str, str, int]:
    """strategy="auto" (measured calibration, different on each rank): two
    calls on one mask, one choice logged, results equal flex_attention (at
    this size the fixed costs make it the all-gather; the ring's results
    under auto are checked in _check_memory_limit)."""
    (q, k, v, cot, full, lb), (lq, lk, lv, lcot, mask) = flex_case("window", 256, 32, "none")
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
    _, (q, k, v, _, mask) = flex_case(kind, 256, 32, "none")
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
    (q, k, v, cot, full, lb), (lq, lk, lv, lcot, mask) = flex_case("causal", 256, 32, "none")
    between = cplib.AutoStrategy(calibration="cpu", margin=0.0,
                                 memory_limit=int((peaks["p2p"] + peaks["allgather"]) / 2))
    try:
        with cpu_flex_grads():
            ref = flex_reference(q, k, v, full, None, False, cot, torch.zeros(q.shape[:3]))
            want = cplib.shard(mesh(), [ref[0], ref[2], ref[3], ref[4]], [2] * 4, lb)
            a, b, c = (t.clone().requires_grad_(True) for t in (lq, lk, lv))
            style = flex_style(between)
            with counting_wire() as wire:
                out = flex_model(None, style)(a, b, c, block_mask=mask)
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
                flex_model(below)(lq, lk, lv, block_mask=mask)
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
    _, (q, k, v, _, mask) = flex_case("window", 256, 32, "none")
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
    (q, k, v, cot, full, lb), (lq, lk, lv, _, mask) = flex_case("causal", 256, 32, "head_tail")
    model = torch.compile(flex_model(CPU), backend="aot_eager", fullgraph=True)
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
