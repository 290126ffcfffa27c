"""The rank pool itself: a failing task must not leak into the next test (no
stale results, fresh ranks after a failure), nor a task's groups into the
next task (each gloo group's threads wake every 10 ms for the life of the
process), and the threaded group runs on every supported torch."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist


def _rank_and_pid() -> tuple[int, int]:
    return dist.get_rank(), os.getpid()


def _fail_on_rank_1_after_a_collective_wait() -> int:
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 fails on purpose")
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 1 never joins: this rank stays blocked
    return 99


def _fail_on_rank_0_only() -> int:
    if dist.get_rank() == 0:
        raise RuntimeError("rank 0 fails on purpose")
    return 38


def _sum_of_ranks() -> int:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return int(t.item())


def test_failure_then_fresh_ranks_and_no_stale_results(ranks, monkeypatch):
    import harness

    before = ranks(2).run(_rank_and_pid)
    # A rank blocked in a collective: the run fails quickly (grace period,
    # not the group timeout) and the pool is closed. The blocked rank never
    # answers, so a short grace decides nothing here but the wait.
    monkeypatch.setattr(harness, "FAILURE_GRACE_S", 2.0)
    with pytest.raises(AssertionError, match="rank 1 fails on purpose"):
        ranks(2).run(_fail_on_rank_1_after_a_collective_wait)
    after = ranks(2).run(_rank_and_pid)
    assert [r for r, _ in after] == [0, 1]
    assert {p for _, p in after}.isdisjoint({p for _, p in before}), "ranks were not respawned"
    # A rank that fails while the other answers: that answer is not read by the next task.
    with pytest.raises(AssertionError, match="rank 0 fails on purpose"):
        ranks(2).run(_fail_on_rank_0_only)
    assert ranks(2).run(_sum_of_ranks) == [1, 1]
    assert ranks(2).run(_rank_and_pid)[1][0] == 1


def _groups_in_this_process() -> list[str]:
    return sorted(g.group_name for g in dist.distributed_c10d._world.pg_map)


def _make_groups() -> str:
    """A new group, a 2-D mesh's, and one kept for later tasks."""
    import pool_groups
    from torch.distributed.device_mesh import init_device_mesh

    dist.new_group([0, 1])
    init_device_mesh("cpu", (1, 2), mesh_dim_names=("a", "b"))
    return pool_groups.keep_group(dist.new_group([0, 1])).group_name


def test_a_tasks_groups_end_with_it_unless_kept(ranks):
    before = ranks(2).run(_groups_in_this_process)
    kept = ranks(2).run(_make_groups)
    after = ranks(2).run(_groups_in_this_process)
    try:
        assert after == [sorted([*b, k]) for b, k in zip(before, kept)]
    finally:
        ranks(2).run(_forget_kept_group)


def _forget_kept_group() -> None:
    import pool_groups

    group = pool_groups._kept_groups.pop()
    dist.destroy_process_group(group)


def _threaded_identity() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def test_threaded_group_runs_twice(threaded):
    # Twice in a row: the first run must tear down cleanly on every torch
    # (2.11's threaded world cannot be destroyed from a rank thread).
    for _ in range(2):
        assert threaded(3, _threaded_identity) == [(0, 3), (1, 3), (2, 3)]
