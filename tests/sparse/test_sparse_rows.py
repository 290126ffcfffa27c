"""cplib.sparse's rows of a sharded sequence read by other ranks
(cplib/sparse/rows.py), against the same reads of the whole sequence in one
process (float64): the rows, and the gradient of each rank's own rows;
gather and fetch, sequential shards of uneven length and head-tail shards,
1, 2 and 4 ranks. The bytes each rank receives, counted where cplib hands
its collectives to torch (tests/support/wire_count.py), are the plan's, and
"auto" takes the way that moves fewer bytes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cplib.attention.layout import shard_positions
from cplib.sparse import RowLayout, all_rows, plan_rows, take_rows
from harness import assert_close
from wire_count import counting_wire

TOL = dict(atol=1e-12, rtol=1e-12)


def _layout(s: int, head_tail: bool) -> RowLayout:
    n, rank = dist.get_world_size(), dist.get_rank()
    positions = tuple(shard_positions(s, n, r, head_tail) for r in range(n))
    return RowLayout(positions, rank, dist.group.WORLD.group_name if n > 1 else None, s)


def _needed(s: int, rank: int, how: str) -> torch.Tensor:
    """The positions a rank reads: a few near its own (a local selection)
    or nearly all of them (what a long causal selection reads)."""
    g = torch.Generator().manual_seed(11 + rank)
    if how == "few":
        return torch.unique(torch.randint(0, s, (3,), generator=g))
    return torch.unique(torch.randint(0, s, (4 * s,), generator=g))


def _check(s: int, head_tail: bool, how: str, strategy: str) -> tuple[str, int, int]:
    layout = _layout(s, head_tail)
    rank = layout.rank
    full = torch.randn(2, s, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(s))
    needed = _needed(s, rank, how)
    cot = torch.randn(2, needed.numel(), 5, dtype=torch.float64,
                      generator=torch.Generator().manual_seed(rank))
    mine = full[:, layout.positions[rank]].clone().requires_grad_()
    row_bytes = 2 * 5 * 8
    with counting_wire() as wire:
        plan = plan_rows(needed, layout, row_bytes, strategy)
        got = take_rows(mine, needed, layout, plan)
        received = wire.take()[1]
        (got * cot).sum().backward()
    what = f"S={s} head_tail={head_tail} {how} {strategy} n={layout.world} rank {rank}"
    assert_close(got, full[:, needed], what=f"{what}: rows", **TOL)
    # The reference gradient: every rank's cotangent added into the rows it read.
    want = torch.zeros_like(full)
    for r in range(layout.world):
        theirs = _needed(s, r, how)
        want[:, theirs] += torch.randn(2, theirs.numel(), 5, dtype=torch.float64,
                                       generator=torch.Generator().manual_seed(r))
    assert_close(mine.grad, want[:, layout.positions[rank]], what=f"{what}: grad", **TOL)
    assert received == plan.received, f"{what}: received {received}, plan {plan.received}"
    return plan.strategy, plan.received, plan.other


def _rows_cases(s: int) -> list:
    out = []
    for head_tail in (False, True):
        for how in ("few", "most"):
            for strategy in ("gather", "fetch", "auto"):
                out.append((how, strategy, _check(s, head_tail, how, strategy)))
    return out


@pytest.mark.parametrize("n", [1, 2, 4])
def test_rows_gathered_or_fetched_are_one_process_reads(ranks, n):
    for rank_results in ranks(n).run(_rows_cases, 37):  # 37: uneven shards
        for how, strategy, (chosen, received, other) in rank_results:
            if n == 1:
                assert chosen == "local" and received == 0
            elif strategy == "auto":  # the cheaper one, by the slowest rank's bytes
                assert chosen == ("fetch" if how == "few" else "gather"), (how, chosen)
            else:
                assert chosen == strategy


def _all_rows_case(s: int, head_tail: bool) -> None:
    layout = _layout(s, head_tail)
    full = torch.randn(3, s, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    mine = full[:, layout.positions[layout.rank]].clone().requires_grad_()
    got = all_rows(mine, layout)
    cot = torch.randn(got.shape, dtype=torch.float64,
                      generator=torch.Generator().manual_seed(6 + layout.rank))
    (got * cot).sum().backward()
    want = sum(torch.randn(got.shape, dtype=torch.float64,
                           generator=torch.Generator().manual_seed(6 + r))
               for r in range(layout.world))
    assert_close(got, full, what="all_rows", **TOL)
    assert_close(mine.grad, want[:, layout.positions[layout.rank]], what="all_rows grad", **TOL)


@pytest.mark.parametrize("n", [2, 4])
def test_all_rows_is_the_whole_sequence_and_sums_gradients_on_owners(ranks, n):
    for head_tail in (False, True):
        ranks(n).run(_all_rows_case, 30, head_tail)
