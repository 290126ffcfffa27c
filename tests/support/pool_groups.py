"""The process groups of a pooled rank (tests/support/harness.py): a task's
groups end with the task unless it keeps them (``keep_group``) or cplib's
caches hold them for the life of the process. Each gloo group holds a
transport thread that wakes every 10 ms and two workers until destroyed:
the hundreds that the suite's tasks made and left behind burned most of a
core in each idle pooled rank by the end of a run, slowing every later
test."""

from __future__ import annotations

import sys

import torch.distributed as dist

__all__ = ["destroy_groups_made_since", "groups", "keep_group"]

# Groups a task makes that later tasks reuse (a module's cached side group):
# kept past the task that made them (see keep_group).
_kept_groups: list[dist.ProcessGroup] = []


def keep_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """Marks ``group``, made in a task on pooled ranks, as one later tasks
    reuse: it outlives the task (every other group it made does not)."""
    _kept_groups.append(group)
    return group


def groups() -> list[dist.ProcessGroup]:
    return list(dist.distributed_c10d._world.pg_map)


def _groups_cplib_keeps() -> set[str]:
    """The groups cplib makes once per process and reuses from its caches:
    USP's subgroups, pure Ulysses's one-rank group, NCCL's handshake side
    groups."""
    names: set[str | None] = set()
    usp = sys.modules.get("cplib.ulysses.usp_layout")
    if usp is not None:
        for found in usp._cache.values():
            names |= {found.ulysses_group, found.ring_group}
    ulysses = sys.modules.get("cplib.ulysses.op")
    if ulysses is not None:
        names |= set(ulysses._self.values())
    handshake = sys.modules.get("cplib.comm.handshake")
    if handshake is not None:
        names |= set(handshake.side_groups.values())
    return {n for n in names if n is not None}


def destroy_groups_made_since(before: list[dist.ProcessGroup]) -> None:
    """Destroys the groups a task made (``dist.new_group``, a mesh's
    dimensions) that neither it (keep_group) nor cplib's caches keep."""
    kept = _groups_cplib_keeps()
    for group in groups():
        if any(group is g for g in (*before, *_kept_groups)) or group.group_name in kept:
            continue
        try:
            dist.destroy_process_group(group)
        except Exception:  # already gone, or torch refuses: not this task's concern
            pass
