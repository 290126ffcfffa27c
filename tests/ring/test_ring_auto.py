"""``ring_sdpa(rotate="auto")`` on gloo ranks (cplib/ring/entry.py): the
measured calibration (collective), one choice on every rank, logged once for
two calls of one shape, outputs and gradients against one process, and a
compiled call (fullgraph) that leaves the choice out of its graph."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

import cplib
from cplib.strategy import choice as choice_mod
from harness import assert_close
from ring_cases import reference
from strategy_cases import TOL, compare, inputs, world_mesh


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _check_ring_auto() -> tuple[str, int]:
    """ring_sdpa(rotate="auto"): measured calibration (collective), one
    logged choice for two calls of one shape, the reference's results."""
    mesh, n, rank = world_mesh(), dist.get_world_size(), dist.get_rank()
    q, k, v, cot = inputs(1, 4, 2, 16 * n, 8, 10)
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
            compare(got, ref, f"ring_sdpa rotate=auto rank {rank}")
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
