"""``_enable_context_parallel_dispatcher()`` routes the fused SDPA kernels of
sequence-sharded DTensors to cplib's ring (cplib/frontend/dtensor_sdpa.py).
Every kernel's forward and backward handler (the CPU flash kernel, and the
CUDA flash, efficient and cuDNN ones, called here on CPU DTensors: the same
argument binding, extra outputs and backward arguments as on a GPU) gives
the one-process output and q, k, v gradients on 2 gloo ranks, head-tail;
DTensors the ring cannot take (replicated, dropout) raise
NotImplementedError on every rank before any collective."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from harness import assert_close

aten = torch.ops.aten
# forward op -> (its positional arguments after q, k, v; the backward op)
_KERNELS = {
    "cpu flash": (aten._scaled_dot_product_flash_attention_for_cpu.default, (0.0, True),
                  aten._scaled_dot_product_flash_attention_for_cpu_backward.default),
    "flash": (aten._scaled_dot_product_flash_attention.default, (0.0, True, False),
              aten._scaled_dot_product_flash_attention_backward.default),
    "efficient": (aten._scaled_dot_product_efficient_attention.default, (None, True, 0.0, True),
                  aten._scaled_dot_product_efficient_attention_backward.default),
    "cudnn": (aten._scaled_dot_product_cudnn_attention.default, (None, True, 0.0, True, False),
              aten._scaled_dot_product_cudnn_attention_backward.default),
}


def _backward_args(op, grad_out, q, k, v, outputs) -> dict:
    """The backward op's arguments by name, from the forward's outputs (as
    autograd's formula passes them)."""
    names = [r.name for r in op._schema.returns]
    given = dict(zip(["output" if n == "output" else n for n in names], outputs))
    given.update(grad_out=grad_out, grad_out_=grad_out, query=q, key=k, value=v,
                 out=outputs[0], logsumexp=outputs[1], dropout_p=0.0, is_causal=True,
                 attn_bias=None, grad_input_mask=[True, True, True, False],
                 philox_seed=given.get("philox_seed", given.get("rng_state")),
                 philox_offset=given.get("philox_offset", given.get("unused")))
    return given


def _kernels() -> int:
    import cplib
    from torch.distributed.tensor import DTensor, Shard

    from cplib.frontend.dtensor_sdpa import _backward_handler, _forward_handler

    n = dist.get_world_size()
    mesh = DeviceMesh("cpu", list(range(n)))
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 32, 8, requires_grad=True) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    want.backward(torch.ones_like(want))
    balancer = cplib._HeadTailLoadBalancer(32, n, "cpu")
    shards = cplib._context_parallel_shard(mesh, [q.detach(), k.detach(), v.detach(), want,
                                                  q.grad, k.grad, v.grad], [2] * 7, balancer)
    dq, dk, dv = (DTensor.from_local(t, mesh, [Shard(2)]) for t in shards[:3])
    for name, (forward, extra, backward) in _KERNELS.items():
        outputs = _forward_handler(forward, (dq, dk, dv, *extra), {})
        assert len(outputs) == len(forward._schema.returns), name
        assert_close(outputs[0].to_local(), shards[3], atol=1e-5, rtol=1e-5, what=f"{name} out")
        grad_out = DTensor.from_local(torch.ones_like(shards[3]), mesh, [Shard(2)])
        named = _backward_args(forward, grad_out, dq, dk, dv, outputs)
        positional = tuple(named[a.name] for a in backward._schema.arguments if not a.kwarg_only)
        grads = _backward_handler(backward, positional, {})
        assert len(grads) == len(backward._schema.returns), name
        for which, got, expected in zip("qkv", grads, shards[4:]):
            assert_close(got.to_local(), expected, atol=1e-5, rtol=1e-5, what=f"{name} d{which}")
    return len(_KERNELS)


def test_every_kernels_handlers_equal_one_process(ranks):
    assert ranks(2).run(_kernels) == [4, 4]


def _rejected(case: str) -> str:
    import cplib
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = DeviceMesh("cpu", list(range(dist.get_world_size())))
    q = torch.randn(1, 2, 8, 4)
    placement, dropout = ([Replicate()], 0.0) if case == "replicated" else ([Shard(2)], 0.5)
    t = DTensor.from_local(q, mesh, placement)
    cplib._enable_context_parallel_dispatcher()
    try:
        if dropout:  # SDPA takes its math path for dropout on CPU: the kernel's op directly
            aten._scaled_dot_product_flash_attention_for_cpu(t, t, t, dropout, True)
        else:
            F.scaled_dot_product_attention(t, t, t, is_causal=True)
    except NotImplementedError as exc:
        return str(exc)
    finally:
        cplib._disable_context_parallel_dispatcher()
    return "no error"


def test_what_the_ring_cannot_take_raises_on_every_rank(ranks):
    for case, words in (("replicated", "query is (Replicate(),)"), ("dropout", "dropout_p=0.5")):
        errors = ranks(2).run(_rejected, case)
        assert errors[0] == errors[1] and words in errors[0], (case, errors)
