"""A context-parallel flex module computes what the module computes
(``_ContextParallel(seq_dim=2, AttentionType.FLEX)``; gloo, CPU): its
forward runs as written, and only its flex_attention calls run over the
whole sequence, on every rotation. Against the same module on the whole
sequence in one process (float64), out and the gradients of q, k and v
within torch's flex CP tolerance (atol 2e-6, rtol 1e-5):

* a module whose forward is ``2 * flex_attention(...) + 0.25``, and one
  that makes two flex calls on two groups of heads (its own score_mod and
  scale each, ``return_aux`` and the deprecated ``return_lse``, one call's
  lse gating its output), at world sizes 2 and 4, causal head-tail mask;
* a module holding ``torch.compile(flex_attention)`` (as torchtitan's):
  the call stays compiled, with no flex_attention call made eagerly in the
  forward or the backward, each ring step a flex op in the compiled graph.

Today's failures these pin: the ring replaced the module's forward by a
bare flex call (the first two: error 2.57), and called flex eagerly per
step, the module's compiled flex never running."""

from __future__ import annotations

import unittest.mock

import pytest
import torch
import torch.nn.attention.flex_attention as fa
from torch import nn
from torch.distributed.tensor.parallel import parallelize_module
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask

import cplib
from cplib import _context_parallel_shard, _ContextParallel
from flex_cases import balancer, causal, cpu_flex_grads, mesh, randn, rotate
from harness import assert_close

TOL = dict(atol=2e-6, rtol=1e-5)
DIM = 16
ROTATIONS = ("p2p", "alltoall", "allgather")


def _relative(score, b, h, q_idx, kv_idx):
    return score - 0.05 * (q_idx - kv_idx).abs()


class ScaledFlex(nn.Module):
    def forward(self, q, k, v, block_mask=None):
        return 2.0 * fa.flex_attention(q, k, v, block_mask=block_mask) + 0.25


class TwoHeadGroups(nn.Module):
    """Two flex calls, on the first and second half of the heads."""

    def forward(self, q, k, v, block_mask=None):
        h = q.shape[1] // 2
        first, aux = fa.flex_attention(q[:, :h], k[:, :h], v[:, :h], score_mod=_relative,
                                       block_mask=block_mask, scale=0.3,
                                       kernel_options={"BACKEND": "AUTO"},
                                       return_aux=AuxRequest(lse=True))
        second, lse = fa.flex_attention(q[:, h:], k[:, h:], v[:, h:], block_mask=block_mask,
                                        return_lse=True)
        gate = torch.sigmoid(aux.lse - lse).unsqueeze(-1)
        return torch.cat([first * gate, second + 0.1 * lse.unsqueeze(-1)], dim=1)


class CompiledFlex(nn.Module):
    """Holds a compiled flex_attention, as torchtitan's FlexAttention does."""

    def __init__(self, backend) -> None:
        super().__init__()
        self.flex = torch.compile(fa.flex_attention, backend=backend, fullgraph=True)

    def forward(self, q, k, v, block_mask=None):
        return 2.0 * self.flex(q, k, v, score_mod=_relative, block_mask=block_mask) + 0.25


def _one_process(module: nn.Module, inputs, mask, cot) -> list[torch.Tensor]:
    q, k, v = (t.double().requires_grad_(True) for t in inputs)
    out = module(q, k, v, block_mask=mask)
    out.backward(cot.double())
    return [out.detach(), q.grad, k.grad, v.grad]


def _cp(module: nn.Module) -> nn.Module:
    return parallelize_module(module, mesh(), _ContextParallel(
        seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX))


def _check_module(make, S: int, rotations=ROTATIONS, heads: int = 4) -> list[str]:
    """``make()``'s module sharded head-tail with a causal mask against one
    process, on each rotation; returns what it checked."""
    inputs = [randn((1, heads, S, DIM), seed) for seed in (1, 2, 3)]
    cot = randn((1, heads, S, DIM), 4)
    full = create_block_mask(causal, 1, 1, S, S, device="cpu", BLOCK_SIZE=32)
    lb = balancer("head_tail", S, full, None)
    done = []
    with cpu_flex_grads():
        want = cplib.shard(mesh(), _one_process(make(), inputs, full, cot), [2] * 4, lb)
        with torch.compiler.set_stance("force_eager"):
            *local, lcot, mask = _context_parallel_shard(mesh(), [*inputs, cot, full],
                                                        [2] * 4 + [0], lb)
        model = _cp(make())
        for method in rotations:
            lq, lk, lv = (t.clone().requires_grad_(True) for t in local)
            with rotate(method):
                out = model(lq, lk, lv, block_mask=mask)
                out.backward(lcot)
            for name, got, exp in zip(("out", "dq", "dk", "dv"),
                                      (out, lq.grad, lk.grad, lv.grad), want):
                assert_close(got.detach().double(), exp, what=f"{method}: {name}", **TOL)
            done.append(method)
    return done


@pytest.mark.parametrize("world", [2, 4])
def test_module_forward_runs_around_the_flex_call(ranks, world):
    assert ranks(world).run(_check_module, ScaledFlex, 256) == [list(ROTATIONS)] * world


def test_several_flex_calls_in_one_forward(ranks):
    assert ranks(2).run(_check_module, TwoHeadGroups, 256) == [list(ROTATIONS)] * 2


def _counting_flex(eager: list):
    """flex_attention that notes each call made outside a trace."""
    original = fa.flex_attention

    def flex_attention(*args, **kwargs):
        if not torch.compiler.is_compiling():
            eager.append(1)
        return original(*args, **kwargs)
    return flex_attention


def _flex_ops(graph_module: torch.fx.GraphModule) -> int:
    """flex ops in a compiled graph and its subgraphs (the ring's autograd
    function keeps its forward in one)."""
    return sum(node.target is torch.ops.higher_order.flex_attention
               for gm in graph_module.modules() if isinstance(gm, torch.fx.GraphModule)
               for node in gm.graph.nodes)


def _check_compiled_flex_stays_compiled() -> list[int]:
    from torch._dynamo.testing import CompileCounterWithBackend
    from cplib.flex.plan import SHARD_ATTR

    counter = CompileCounterWithBackend("aot_eager")
    done = _check_module(lambda: CompiledFlex(counter), 256, rotations=("p2p",), heads=2)
    assert done == ["p2p"]
    S = 256
    full = create_block_mask(causal, 1, 1, S, S, device="cpu", BLOCK_SIZE=32)
    lb = balancer("head_tail", S, full, None)
    with torch.compiler.set_stance("force_eager"):
        *local, mask = _context_parallel_shard(
            mesh(), [randn((1, 2, S, DIM), seed) for seed in (1, 2, 3)] + [full], [2] * 3 + [0],
            lb)
    steps = getattr(mask, SHARD_ATTR).calls
    eager: list = []
    model = _cp(CompiledFlex(counter))
    with cpu_flex_grads(), rotate("p2p"), \
            unittest.mock.patch.object(fa, "flex_attention", _counting_flex(eager)):
        lq = local[0].clone().requires_grad_(True)
        model(lq, *local[1:], block_mask=mask).sum().backward()
    assert max(_flex_ops(g) for g in counter.graphs) >= steps
    return [len(eager), steps]


def test_compiled_flex_call_stays_compiled(ranks):
    """No flex_attention call runs outside the module's compiled one (each
    ring step is a flex op of its graph), forward and backward; and the
    result is the module's."""
    got = ranks(2).run(_check_compiled_flex_stays_compiled)
    assert [eager for eager, _ in got] == [0, 0], got
    assert all(steps == 2 for _, steps in got), got


def _check_auto_serves_what_the_ring_cannot() -> int:
    """strategy="auto" runs a call whose plan the ring cannot serve (key
    blocks of 64 rows, shards of 96) on the all-gather, exactly; the ring
    itself refuses it (test_flex_ring_plan.py's bad input)."""
    S = 192
    inputs = [randn((1, 2, S, DIM), seed) for seed in (1, 2, 3)]
    full = create_block_mask(causal, 1, 1, S, S, device="cpu", BLOCK_SIZE=(32, 64))
    with cpu_flex_grads():
        want = cplib.shard(mesh(), _one_process(ScaledFlex(), inputs, full, inputs[0]), [2] * 4)
        with torch.compiler.set_stance("force_eager"):
            *local, mask = _context_parallel_shard(mesh(), [*inputs, full], [2] * 3 + [0])
        model = parallelize_module(ScaledFlex(), mesh(), _ContextParallel(
            seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX, strategy="auto"))
        lq, lk, lv = (t.clone().requires_grad_(True) for t in local)
        out = model(lq, lk, lv, block_mask=mask)
        out.backward(local[0])
    for name, got, exp in zip(("out", "dq", "dk", "dv"), (out, lq.grad, lk.grad, lv.grad), want):
        assert_close(got.detach().double(), exp, what=f"auto: {name}", **TOL)
    return 1


def test_auto_takes_the_all_gather_where_the_ring_cannot_serve(ranks):
    assert ranks(2).run(_check_auto_serves_what_the_ring_cannot) == [1, 1]


def _check_captured_bias_on_the_all_gather() -> float:
    """A score_mod that reads a bias requiring grad (by the key's global
    position): the all-gather differentiates it as flex does (its gradient
    summed over the ranks equals one process's); the ring refuses it
    (test_flex_ring_plan.py's bad input)."""
    import torch.distributed as dist

    S = 256
    inputs = [randn((1, 2, S, DIM), seed).double() for seed in (1, 2, 3)]
    full = create_block_mask(causal, 1, 1, S, S, device="cpu", BLOCK_SIZE=32)
    bias = randn((S,), 5).double().requires_grad_(True)

    class Biased(nn.Module):
        def forward(self, q, k, v, block_mask=None):
            return fa.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + bias[ki],
                                     block_mask=block_mask)

    lb = balancer("head_tail", S, full, None)
    with cpu_flex_grads(), rotate("allgather"):
        Biased()(*inputs, block_mask=full).sum().backward()
        want, bias.grad = bias.grad.clone(), None
        with torch.compiler.set_stance("force_eager"):
            *local, mask = _context_parallel_shard(mesh(), [*inputs, full], [2] * 3 + [0], lb)
        _cp(Biased())(*local, block_mask=mask).sum().backward()
    got = bias.grad.clone()
    dist.all_reduce(got)
    assert_close(got, want, what="the bias's gradient", **TOL)
    return float(got.abs().sum())


def test_all_gather_differentiates_captured_tensors(ranks):
    got = ranks(2).run(_check_captured_bias_on_the_all_gather)
    assert got[0] == got[1] > 0, got
