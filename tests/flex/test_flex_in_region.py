"""flex_attention under cplib's SDPA dispatch (a ``cplib.context_parallel``
region): a call that no ``_ContextParallel(FLEX)`` module takes over raises
NotImplementedError on every rank, eagerly and compiled, instead of
attending within each rank's shard; a FLEX module's forward inside a region
still runs over the whole sequence, exactly, eager or in a whole model
compiled (gloo, CPU).

Before, on 2 ranks (S = 64, fp32): the region ran the call on each shard,
max error 1.24 against one process, silently."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.attention.flex_attention as fa
from torch import nn
from torch.distributed.tensor.parallel import parallelize_module
from torch.nn.attention.flex_attention import create_block_mask

import cplib
from cplib import _context_parallel_shard, _ContextParallel
from flex_cases import balancer, causal, cpu_flex_grads, mesh, randn
from harness import assert_close

TOL = dict(atol=2e-6, rtol=1e-5)  # torch's flex CP tolerance, as test_flex_module.py


def _direct_call(compiled: bool) -> str:
    S = 32 * dist.get_world_size()
    q, k, v = (randn((1, 2, S, 16), seed) for seed in (1, 2, 3))
    flex = torch.compile(fa.flex_attention, backend="eager") if compiled else fa.flex_attention
    with cplib.context_parallel(mesh(), buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
        try:
            flex(q, k, v)
        except NotImplementedError as exc:
            return str(exc)
    return "no error"


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_flex_call_in_a_region_raises_on_every_rank(ranks, compiled):
    got = ranks(2).run(_direct_call, compiled)
    assert got[0] == got[1], got
    assert "flex_attention call in a cplib.context_parallel region" in got[0], got[0]
    assert "_ContextParallel(attention_type=FLEX)" in got[0], got[0]


def _relative(score, b, h, q_idx, kv_idx):
    return score - 0.05 * (q_idx - kv_idx).abs()


class ScaledFlex(nn.Module):
    def forward(self, q, k, v, block_mask=None):
        return 2.0 * fa.flex_attention(q, k, v, score_mod=_relative, block_mask=block_mask) + 0.25


def _flex_module_in_region(whole_model_compiled: bool) -> int:
    S = 256
    inputs = [randn((1, 2, S, 16), seed) for seed in (1, 2, 3)]
    full = create_block_mask(causal, 1, 1, S, S, device="cpu", BLOCK_SIZE=32)
    lb = balancer("head_tail", S, full, None)
    with cpu_flex_grads():
        q, k, v = (t.double().requires_grad_(True) for t in inputs)
        ref = ScaledFlex()(q, k, v, block_mask=full)
        ref.sum().backward()
        want = cplib.shard(mesh(), [ref.detach(), q.grad, k.grad, v.grad], [2] * 4, lb)
        with torch.compiler.set_stance("force_eager"):
            *local, mask = _context_parallel_shard(mesh(), [*inputs, full], [2] * 3 + [0], lb)
        model = parallelize_module(ScaledFlex(), mesh(), _ContextParallel(
            seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX))
        if whole_model_compiled:
            model = torch.compile(model, backend="aot_eager")
        lq, lk, lv = (t.clone().requires_grad_(True) for t in local)
        x = torch.zeros(1, S // dist.get_world_size())  # the region's (SDPA) layers' input
        with cplib.context_parallel(mesh(), buffers=[x], buffer_seq_dims=[1]):
            out = model(lq, lk, lv, block_mask=mask)
            out.sum().backward()  # the ring's backward recomputes blocks with flex
    for name, got, exp in zip(("out", "dq", "dk", "dv"), (out, lq.grad, lk.grad, lv.grad), want):
        assert_close(got.detach().double(), exp, what=name, **TOL)
    return 1


@pytest.mark.parametrize("whole_model_compiled", [False, True], ids=["eager", "compiled"])
def test_flex_module_inside_a_region_runs_over_the_whole_sequence(ranks, whole_model_compiled):
    assert ranks(2).run(_flex_module_in_region, whole_model_compiled) == [1, 1]

