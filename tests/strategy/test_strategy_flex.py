"""strategy="auto"'s model of FLEX calls (gloo, CPU): the flex ring's
predicted bytes each rank receives equal the bytes that crossed the process
group into it (counted at torch's collectives, tests/support/wire_count.py,
not from the plan) and a count made from the dense mask alone, for causal,
window and documents masks at N=2 and 4, forward and forward+backward. The
choice between the flex ring and the all-gather, and its runs:
tests/flex/test_flex_strategy.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from cplib.flex import plan as flex_plan
from cplib.flex.strategy_route import _workload, flex_stats
from cplib.strategy.calibration import default_for
from cplib.strategy.cost import predict
from flex_auto_cases import CPU, DIM, RING, flex_case, flex_model, mask_mod_of
from flex_cases import balancer, cpu_flex_grads, mesh, rotate
from wire_count import counting_wire


def _needed_blocks(kind: str, S: int, block: int, lb_kind: str) -> torch.Tensor:
    """``(N, N)``: how many key blocks of rank j rank i's queries see, from
    the dense mask on the original positions and the balancer's permutation
    alone (no BlockMask, no plan). The flex ring moves whole key blocks."""
    n = dist.get_world_size()
    mask_mod, lengths = mask_mod_of(kind, S)
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
        ring = flex_model(None)  # the flex ring, without a strategy
        for kind, S, block, lb_kind in cases:
            _, (q, k, v, cot, mask) = flex_case(kind, S, block, lb_kind)
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
