"""Bad input to the front end (shard, unshard, context_parallel and SDPA or
MultiheadAttention inside it, the _ContextParallel style): its cases of the
bad-input matrix (tests/support/bad_input.py: every rank raises alike,
quickly, naming what is wrong), and unshard's own check in a world of one."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import cplib
from bad_input import check, names


@pytest.mark.parametrize("name", names("frontend"))
def test_every_rank_raises_alike(name):
    check(name)


def _unshard_without_handshake() -> None:
    # A world of one makes no handshake: the shard is checked on its own.
    from cplib.ring.load_balancer import _HeadTailLoadBalancer
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    with pytest.raises(ValueError, match=r"buffer 0 has length 12 along seq_dim 1 on rank 0, but "
                                         r"the load balancer's layout of seq_length=16 over 1 "
                                         r"ranks gives it 16"):
        cplib.unshard(mesh, [torch.randn(1, 12)], [1], _HeadTailLoadBalancer(16, 1, "cpu"))
    full = torch.randn(1, 16)
    torch.testing.assert_close(cplib.unshard(mesh, [full], [1],
                                             _HeadTailLoadBalancer(16, 1, "cpu"))[0], full)


def test_unshard_checks_its_own_length_without_handshake(threaded):
    threaded(1, _unshard_without_handshake)
