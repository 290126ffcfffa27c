"""cplib across destroy_process_group() and a new init (issue 34, section 3).

torch reuses group names after a new init ("0" is the world again, "1" the
first new group...). What cplib keeps per group (the handshake's routes, the
CPU side groups of NCCL groups, Ulysses' groups of one rank, USP's groups) is
keyed by the group object (cplib/comm/native.py: group_token), so a new group
under an old name gets fresh ones instead of a dead group or another group of
that name. On two gloo processes of their own: init, run, destroy, init
again, run again; an NCCL group is played by a gloo group that cplib is told
takes no CPU tensors (it then gets a CPU side group, as on NCCL).
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

import cplib
from cplib.comm import native as _native
from cplib.comm.native import ops
from harness import RankPool


def _step(group) -> None:
    """A ring fwd+bwd on ``group``, and Ulysses with a window (its ring of one
    rank runs on a group of this process alone)."""
    rank = dist.get_rank()
    x = torch.randn(1, 2, 8, 4, generator=torch.Generator().manual_seed(rank),
                    requires_grad=True)
    out, _ = cplib.ring_sdpa(x, x, x, group, is_causal=True)
    out.sum().backward()
    out, _ = cplib.ulysses_sdpa(x.detach(), x.detach(), x.detach(), group, window=3)
    assert torch.isfinite(out).all()


def _generation(nccl_like: set) -> dict:
    """One init's run: a second group over every rank, treated as NCCL (it
    gets a CPU side group), then a step on it and on the world."""
    twin = dist.new_group(list(range(dist.get_world_size())))
    nccl_like.add(twin.group_name)
    cplib.register_group(twin)
    _step(twin)
    _step(dist.group.WORLD)
    via, device = ops.handshake_debug_route(twin.group_name)
    c10d = dist.distributed_c10d
    side = c10d._resolve_process_group(via)  # raises for a dead group
    return {"twin": twin.group_name, "via": via, "device": device,
            "side": (dist.get_backend(side), c10d.get_process_group_ranks(side))}


def _reinit(store_path: str) -> list[dict]:
    real = _native.carries_host_tensors
    nccl_like: set = set()
    _native.carries_host_tensors = lambda pg: pg.group_name not in nccl_like and real(pg)
    try:
        first = _generation(nccl_like)
        rank, n = dist.get_rank(), dist.get_world_size()
        dist.destroy_process_group()
        dist.init_process_group("gloo", store=dist.FileStore(store_path, n), rank=rank,
                                world_size=n, timeout=datetime.timedelta(seconds=30))
        nccl_like.clear()
        second = _generation(nccl_like)
    finally:
        _native.carries_host_tensors = real
    return [first, second]


def test_routes_and_groups_after_a_new_init(tmp_path):
    pool = RankPool(2, timeout_s=30)
    try:
        results = pool.run(_reinit, os.path.join(str(tmp_path), "store"))
    finally:
        pool.close()
    for first, second in results:
        # The same names again, each generation's handshakes on a live gloo
        # side group over its ranks, in host memory.
        assert second["twin"] == first["twin"], (first, second)
        for gen in (first, second):
            assert gen["via"] != gen["twin"] and gen["device"] == "cpu", gen
            assert gen["side"] == ("gloo", [0, 1]), gen
