"""A region with buffers keeps its shards' saved tensors under saved-tensor
hooks of its own (frontend/sharding.py: keep_shards_for_backward), so that a
backward after the region sees the shards, not the restored buffers: the
ring's attention op saves q, which is a buffer's shard itself or a tensor
computed from one, and the backward after the region exits matches one
process either way (without the hooks the first fails: "modified by an
inplace operation"). A backward inside the region that builds no graph runs
without them (it saves nothing; mode_kept.autograd_past_shard_hooks), one
with ``create_graph`` under them, and they are back after either."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import cplib
from cplib.frontend.sharding import ShardPack


def _attention(x: torch.Tensor, w: torch.Tensor, q_is_buffer: bool) -> torch.Tensor:
    k = x @ w
    q = x if q_is_buffer else x @ w.t()
    return F.scaled_dot_product_attention(q, k, k, is_causal=True)


def _backward_after_exit(q_is_buffer: bool) -> float:
    n = dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 16, 8, generator=g, dtype=torch.float64)
    w = torch.randn(8, 8, generator=g, dtype=torch.float64, requires_grad=True)
    want = torch.autograd.grad((_attention(x, w, q_is_buffer) ** 2).sum(), w)[0]
    with cplib.context_parallel(mesh, buffers=[x], buffer_seq_dims=[2]):
        loss = (_attention(x, w, q_is_buffer) ** 2).sum()  # this rank's rows
    assert x.shape[2] == 16  # restored: the backward must not read it
    loss.backward()
    dist.all_reduce(w.grad)
    err = (w.grad - want).abs().max().item()
    assert err < 1e-10, (q_is_buffer, err)
    return err


@pytest.mark.parametrize("q_is_buffer", [False, True], ids=["q elsewhere", "q a shard"])
def test_backward_after_exit_either_way(ranks, q_is_buffer):
    assert len(ranks(2).run(_backward_after_exit, q_is_buffer)) == 2


def _shard_hooks_on_top() -> bool:
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return top is not None and isinstance(top[0], ShardPack)


class _SeesHooks(torch.autograd.Function):
    """Identity; its backward notes whether the shard hooks are on top."""

    seen: list[bool] = []

    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, grad):
        _SeesHooks.seen.append(_shard_hooks_on_top())
        return grad


def _hooks_in_backward() -> list[bool]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    x = torch.randn(1, 2, 16, 8, dtype=torch.float64)
    w = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
    _SeesHooks.seen.clear()
    with cplib.context_parallel(mesh, buffers=[x], buffer_seq_dims=[2]):
        loss = (_SeesHooks.apply(x @ w) ** 2).sum()
        loss.backward(retain_graph=True)
        assert _shard_hooks_on_top()
        torch.autograd.grad(loss, w, None, True, True)  # create_graph, by position
        assert _shard_hooks_on_top()
        torch.autograd.backward(loss)
        assert _shard_hooks_on_top()
    assert not _shard_hooks_on_top()
    return list(_SeesHooks.seen)


def test_backward_without_a_graph_runs_past_the_hooks(ranks):
    assert ranks(2).run(_hooks_in_backward) == [[False, True, False]] * 2
