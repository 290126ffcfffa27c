"""The strategy's model on gloo ranks: one choice on every rank even when
each rank's measured calibration differs (the agreed calibration is the
worse of the two), and the model's bytes (priced from the ring's own plan)
equal to the bytes that crossed the process group (counted at torch's
collectives, tests/support/wire_count.py, not from the plan)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import cplib
from cplib.strategy import choice as choice_mod
from cplib.strategy import microbench
from strategy_cases import world_mesh
from wire_count import counting_wire


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

    mesh, n, rank = world_mesh(), dist.get_world_size(), dist.get_rank()
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
