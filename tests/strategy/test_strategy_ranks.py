"""strategy="auto" on gloo ranks: ring_sdpa(rotate="auto"), context_parallel
and _ContextParallel with strategy="auto" against the full computation in one
process (outputs and gradients), one choice on every rank even when each
rank's calibration differs, the choice logged once, a bad strategy on one
rank raising on every rank, the document placement chosen and run where
the call has documents, and the model's bytes (priced from the ring's own
plan) equal to the bytes that crossed the process group (counted at torch's
collectives, tests/support/wire_count.py, not from the plan)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

import cplib
from cplib.strategy import choice as choice_mod
from cplib.strategy import microbench
from cp_runs import dispatched, sharded_fwd_bwd
from harness import assert_close
from ring_cases import global_tensor, reference
from wire_count import counting_wire

TOL = dict(atol=1e-10, rtol=1e-10)
CPU = cplib.AutoStrategy(calibration="cpu")  # no measurement: quick


def _mesh() -> DeviceMesh:
    return DeviceMesh("cpu", list(range(dist.get_world_size())))


def _inputs(b, hq, hkv, s, d, seed):
    return [global_tensor((b, h, s, d), torch.float64, seed + i)
            for i, h in enumerate((hq, hkv, hkv, hq))]


def _compare(got, ref, what):
    for label, g, w in zip(("out", "dq", "dk", "dv"), got, (ref[0],) + tuple(ref[2:])):
        assert_close(g, w, what=f"{label} [{what}]", **TOL)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _check_ring_auto() -> tuple[str, int]:
    """ring_sdpa(rotate="auto"): measured calibration (collective), one
    logged choice for two calls of one shape, the reference's results."""
    mesh, n, rank = _mesh(), dist.get_world_size(), dist.get_rank()
    q, k, v, cot = _inputs(1, 4, 2, 16 * n, 8, 10)
    ref = reference(q, k, v, cot, is_causal=True, scale=None)
    lb = cplib.HeadTailLoadBalancer(16 * n, n, "cpu")
    log = logging.getLogger("cplib")
    records, level = _Records(), log.level
    log.addHandler(records)
    log.setLevel(logging.INFO)
    try:
        for _ in range(2):
            ql, kl, vl, cl = cplib.shard(mesh, [q, k, v, cot], [2] * 4, lb)
            ql, kl, vl = (t.clone().requires_grad_(True) for t in (ql, kl, vl))
            out, _ = cplib.ring_sdpa(ql, kl, vl, mesh.get_group(), is_causal=True,
                                     load_balanced=True, rotate="auto")
            out.backward(cl)
            got = cplib.unshard(mesh, [out.detach(), ql.grad, kl.grad, vl.grad], [2] * 4, lb)
            _compare(got, ref, f"ring_sdpa rotate=auto rank {rank}")
        # Compiled whole (fullgraph): the choice is left out of the graph.
        ql, kl, vl, cl = cplib.shard(mesh, [q, k, v, cot], [2] * 4, lb)

        @torch.compile(backend="aot_eager", fullgraph=True)
        def compiled(a, b, c):
            return cplib.ring_sdpa(a, b, c, mesh.get_group().group_name, is_causal=True,
                                   load_balanced=True, rotate="auto")[0]
        torch._dynamo.reset()
        got = cplib.unshard(mesh, [compiled(ql, kl, vl)], [2], lb)
        assert_close(got[0], ref[0], what=f"compiled rotate=auto rank {rank}", **TOL)
        chosen = [m for m in records.messages if m.startswith("cplib.strategy: ring ")]
        calibrated = [m for m in records.messages if "calibrated cpu" in m]
        assert len(chosen) == 1 and len(calibrated) == 1, records.messages
        return chosen[0].split(" for ")[0], len(records.messages)
    finally:
        log.removeHandler(records)
        log.setLevel(level)
        choice_mod.clear_caches()


def test_ring_sdpa_rotate_auto_matches_reference_and_logs_once(ranks):
    per_rank = ranks(2).run(_check_ring_auto)
    assert len({c for c, _ in per_rank}) == 1  # one choice on every rank


def _check_rank_dependent_calibration() -> tuple[str, str, dict]:
    """Each rank measures something else (monkeypatched): the agreed
    calibration, and so the choice, is still one; and a choice from
    calibrations given per rank (not agreed) is rank 0's on every rank."""
    rank = dist.get_rank()
    name = dist.group.WORLD.group_name
    real = microbench.measure
    base = cplib.strategy.calibration.DEFAULTS["cpu"]

    def fake(group, device, head_dim, dtype, exchange=None):
        from dataclasses import replace
        # Rank 0: a slow link (allgather's one exchange wins); rank 1: fast.
        return replace(base, link_bps=1e6 if rank == 0 else 1e12, latency_s=1e-6,
                       overlap=0.0 if rank == 0 else 1.0)
    microbench.measure = fake
    try:
        w = cplib.strategy.explain.workload_of(seq_len=4096, q_heads=8, head_dim=64,
                                               world_size=2, device_type="cpu")
        cons = cplib.strategy.candidates.Constraints(families=("ring",))
        cal = choice_mod.calibration_for(name, torch.device("cpu"), 64, torch.bfloat16)
        agreed = choice_mod.agreed_choice(name, w, cons, lambda: cal)
        mine = fake(None, None, 64, None)
        local = choice_mod.choose(w, mine, cons).chosen.name  # differs by rank
        given = choice_mod.agreed_choice(name, w.with_layout("head_tail"), cons, lambda: mine)
        return agreed.chosen.name, given.chosen.name, {**cal.as_dict(), "local": local}
    finally:
        microbench.measure = real
        choice_mod.clear_caches()


def test_rank_dependent_calibration_gives_one_choice(ranks):
    per_rank = ranks(2).run(_check_rank_dependent_calibration)
    assert per_rank[0][2]["local"] != per_rank[1][2]["local"]  # the ranks would differ
    assert len({r[0] for r in per_rank}) == 1
    assert len({r[1] for r in per_rank}) == 1 and per_rank[1][1] == per_rank[0][2]["local"]
    cals = [{k: v for k, v in r[2].items() if k != "local"} for r in per_rank]
    assert cals[0] == cals[1] and cals[0]["link_bps"] == 1e6  # the worse of the two


def _attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _check_context_auto() -> list[str]:
    """context_parallel(strategy=...): per-call rotation ("auto"), and the
    entry choice of the Ulysses degree from the attention's shape."""
    mesh, n = _mesh(), dist.get_world_size()
    b, hq, hkv, s, d = 1, 4, 2, 8 * n, 8
    q, k, v, cot = _inputs(b, hq, hkv, s, d, 30)
    ref = reference(q, k, v, cot, is_causal=True, scale=None)
    shape = cplib.AttentionShape(q_heads=hq, kv_heads=hkv, head_dim=d, dtype=torch.float64)
    chosen = []
    # CPU twice: the second context's choice is the cached one, and it still
    # shows in that context's explain.
    for strategy in (CPU, CPU, cplib.AutoStrategy(calibration="cpu", attention=shape),
                     cplib.AutoStrategy(calibration="cpu", attention=shape,
                                        families=("ulysses",))):
        bufs = [t.clone() for t in (q, k, v, cot)]
        with cplib.context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2] * 4,
                                    strategy=strategy) as cp:
            ql, kl, vl, cl = bufs
            for t in (ql, kl, vl):
                t.requires_grad_(True)
            _attention(ql, kl, vl).backward(cl)
            out = _attention(ql, kl, vl)  # a second call of one shape: no new choice
            got = cp.unshard([out.detach(), ql.grad, kl.grad, vl.grad], [2] * 4)
            for t in (ql, kl, vl):
                t.requires_grad_(False)
        _compare(got, ref, f"context_parallel strategy={strategy}")
        made = cplib.explain(cp)
        assert len(made) == 1 and "| * |" in str(made[0])
        chosen.append(made[0].chosen.name)
    assert chosen[0] == chosen[1] and chosen[3] == f"ulysses U={n}"
    choice_mod.clear_caches()
    return chosen


def test_context_parallel_strategy_auto_matches_reference(ranks):
    per_rank = ranks(2).run(_check_context_auto)
    assert per_rank[0] == per_rank[1]


def _check_placement_chosen() -> list[str]:
    """Packed documents that fit one per rank: auto chooses the document
    placement on entry (nothing to exchange) and shards in it; a context
    already in the placement gets its rotation chosen per call. Outputs and
    gradients against the full computation within documents."""
    from ring_mask_cases import masked_reference, visible

    mesh, n = _mesh(), dist.get_world_size()
    s, d = 16 * n, 8
    cu = [16 * r for r in range(n + 1)]  # one document per rank
    q, k, v, cot = _inputs(1, 4, 2, s, d, 70)
    ref = masked_reference(q, k, v, cot, visible(s, causal=True, cu_seqlens=cu))
    shape = cplib.AttentionShape(q_heads=4, kv_heads=2, head_dim=d, dtype=torch.float64)
    chosen = []
    for options in (dict(strategy=cplib.AutoStrategy(calibration="cpu", attention=shape)),
                    dict(strategy=CPU, load_balance="placement")):
        bufs = [t.clone() for t in (q, k, v, cot)]
        with cplib.context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2] * 4,
                                    cu_seqlens=torch.tensor(cu), **options) as cp:
            assert isinstance(cp.load_balancer, cplib.DocumentPlacementLoadBalancer)
            got = sharded_fwd_bwd(cp, bufs, _attention)
        _compare(got, ref, f"placement chosen by auto ({options})")
        chosen.append(cplib.explain(cp)[0].chosen)
    assert chosen[0].layout == chosen[1].layout == "placement", chosen
    choice_mod.clear_caches()
    return [c.name for c in chosen]


def test_auto_chooses_and_runs_the_document_placement(ranks):
    per_rank = ranks(2).run(_check_placement_chosen)
    assert per_rank[0] == per_rank[1]


class _Attn(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _auto_module(seed: int):
    """A causal SDPA module parallelized with strategy="auto", its inputs
    sharded head-tail, and a check of its output against one process."""
    mesh, n = _mesh(), dist.get_world_size()
    q, k, v = (global_tensor((1, 4, 8 * n, 8), torch.float64, seed + i) for i in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    style = cplib._ContextParallel(seq_dim=2, attention_type=cplib._ContextParallel.AttentionType
                                   .SDPA, strategy=CPU)
    attn = parallelize_module(_Attn(), mesh, style)
    lb = cplib.HeadTailLoadBalancer(8 * n, n, "cpu")
    shards = cplib._context_parallel_shard(mesh, [q, k, v], [2, 2, 2], lb)

    def check(out, what):
        (full,) = cplib.context_parallel_unshard(mesh, [out], [2], lb)
        assert_close(full, want, what=what, **TOL)
    return style, attn, shards, check


def _check_module_auto() -> str:
    style, attn, shards, check = _auto_module(60)
    check(dispatched(attn, *shards), "_ContextParallel strategy=auto")
    assert [c.chosen.family for c in cplib.explain(style)] == ["ring"]
    choice_mod.clear_caches()
    return "ok"


def test_context_parallel_style_strategy_auto(ranks):
    assert ranks(2).run(_check_module_auto) == ["ok"] * 2


def _check_rotation_set_after_parallelizing() -> list[int]:
    """set_rotate_method("allgather") made after parallelize_module wins
    over strategy="auto" (no choice made) and the result is exact; back on
    the default rotation, auto chooses again."""
    from flex_cases import rotate

    style, attn, shards, check = _auto_module(80)
    try:
        with rotate("allgather"):
            check(dispatched(attn, *shards), "set_rotate_method after parallelize_module")
        assert cplib.explain(style) == []
        dispatched(attn, *shards)  # the default rotation again: auto chooses
        return [len(cplib.explain(style))]
    finally:
        choice_mod.clear_caches()


def test_rotation_set_after_parallelizing_wins_over_auto(ranks):
    assert ranks(2).run(_check_rotation_set_after_parallelizing) == [[1], [1]]


def _check_bad_strategy_on_one_rank() -> str:
    mesh, rank = _mesh(), dist.get_rank()
    x = torch.randn(1, 2, 8 * dist.get_world_size(), 8)
    with pytest.raises(ValueError) as info:
        with cplib.context_parallel(mesh, buffers=[x], buffer_seq_dims=[2],
                                    strategy="fast" if rank == 1 else "auto"):
            pass
    return str(info.value)


def test_bad_strategy_on_one_rank_raises_on_every_rank(ranks):
    per_rank = ranks(2).run(_check_bad_strategy_on_one_rank)
    assert len(set(per_rank)) == 1 and "strategy='fast'" in per_rank[0]


def _local_rows(layout: str, s: int, n: int, rank: int, docs: dict) -> int:
    """This rank's rows in ``layout``, from the load balancer that shards it."""
    if layout == "per_document":
        return cplib.AnyLengthPerDocumentLoadBalancer(docs["cu_seqlens"], n, "cpu").lengths()[rank]
    if layout == "placement":
        return cplib.DocumentPlacementLoadBalancer(docs["cu_seqlens"], n, "cpu").lengths()[rank]
    return s // n


def _check_bytes_match_the_ring() -> list[tuple[str, float, float]]:
    """The model's bytes (priced from the ring's own plan) are what crossed
    the process group (sent by the rank that sends most), for every layout:
    windows, documents, the causal head-tail ring (which sends only the rows
    a receiver reads), per-document head-tail and the document placement."""
    from cplib.strategy.candidates import Candidate
    from cplib.strategy.cost import predict

    mesh, n, rank = _mesh(), dist.get_world_size(), dist.get_rank()
    s, h, d = 64 * n, 2, 8
    docs = dict(cu_seqlens=[0, 40, 41, 150, s])
    out = []
    for label, layout, kw, rotations in (
            ("window", "sequential", dict(window=(40, 0)), ("p2p", "allgather")),
            ("documents", "sequential", docs, ("p2p", "allgather")),
            ("dense", "sequential", {}, ("p2p", "allgather")),
            ("causal head-tail", "head_tail", {}, ("p2p",)),
            ("per-document", "per_document", docs, ("p2p",)),
            ("placement", "placement", docs, ("p2p", "allgather"))):
        for rotate in rotations:
            w = cplib.strategy.explain.workload_of(
                seq_len=s, q_heads=h, head_dim=d, world_size=n, dtype=torch.float32,
                device_type="cpu", layout=layout, **kw)
            cand = Candidate("ring", rotate, 1, layout)
            predicted = predict(cand, w, cplib.strategy.calibration.DEFAULTS["cpu"]).bytes_sent
            x = torch.randn(1, h, _local_rows(layout, s, n, rank, kw), d).requires_grad_()
            extra = dict(kw, cu_seqlens=torch.tensor(kw["cu_seqlens"])) \
                if "cu_seqlens" in kw else kw
            with counting_wire() as wire:
                o, _ = cplib.ring_sdpa(x, x, x, mesh.get_group(), is_causal=True, rotate=rotate,
                                       load_balanced=layout != "sequential", seq_len=s,
                                       per_document=layout == "per_document",
                                       placement=layout == "placement", **extra)
                o.sum().backward()
            sent = torch.tensor([float(wire.sent)])
            dist.all_reduce(sent, op=dist.ReduceOp.MAX)
            out.append((f"{label} {rotate}", predicted, sent.item()))
    return out


def test_model_bytes_equal_the_bytes_that_crossed(ranks):
    for label, predicted, measured in ranks(4).run(_check_bytes_match_the_ring)[0]:
        assert predicted == measured > 0, label
