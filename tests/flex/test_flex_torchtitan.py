"""torchtitan 0.3.0's flex attention module on the flex ring (2 gloo ranks,
against the same module on the whole sequence in one process).

torchtitan's ``FlexAttention`` takes (B, L, N, H) tensors and an
``attention_masks=`` BlockMask, transposes to flex's layout and calls the
compiled ``flex_attention`` it holds as a class variable. Parallelized with
``_ContextParallel(seq_dim=1, AttentionType.FLEX)``, that compiled call is
taken over by the ring (cplib moves nothing but the call), and out and the
gradients of q, k and v equal one process's within torch's flex CP
tolerance. Inputs and masks are sharded by torchtitan's own ``cp_shard``
(head-tail) on cplib's names (``cplib.patch_torch()``). On CPU the module's
compiled flex is compiled with aot_eager (inductor's CPU flex kernel returns no lse, which the ring
merges with) and torch's CPU flex backward guard is lifted, as in the flex
tests.

torchtitan's ``apply_cp_to_forward`` all-gathers K/V itself
(``flex_cp_allgather`` by name) before the module's forward, so it runs
the all-gather, on cplib's names equal to one process too
(tests/integrations/test_torchtitan.py); the ring is this module path."""

from __future__ import annotations

import contextlib
import unittest.mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.attention.flex_attention as fa
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module
from torch.nn.attention.flex_attention import create_block_mask

import cplib
from cplib.flex.ring_ops import ring_bytes_received
from flex_cases import causal, cpu_flex_grads, randn, rotate
from harness import assert_close

pytest.importorskip("torchtitan", reason="requirements/clients-nodeps.txt")

TOL = dict(atol=2e-6, rtol=1e-5)
# The torch names torchtitan's context-parallel module imports at load.
TORCH_NAMES = ("_context_parallel_shard", "_enable_context_parallel_dispatcher",
               "_HeadTailLoadBalancer", "_PTRRLoadBalancer", "flex_cp_allgather")


@contextlib.contextmanager
def _cplib_names():
    """torchtitan's context-parallel API on cplib's names: cplib.patch_torch()
    before torchtitan's import; a process that imported it earlier (another
    test of this rank pool) gets the names set on the module itself."""
    cplib.patch_torch()
    try:
        from torchtitan.distributed.context_parallel import api

        with contextlib.ExitStack() as stack:
            for name in TORCH_NAMES:
                if getattr(api, name) is not getattr(cplib, name):
                    stack.enter_context(unittest.mock.patch.object(api, name,
                                                                   getattr(cplib, name)))
            yield api
    finally:
        cplib.unpatch_torch()


def _check_torchtitan_flex(method: str) -> int:
    from torchtitan.models.common.attention import FlexAttention

    n, S = dist.get_world_size(), 512
    mesh = DeviceMesh("cpu", list(range(n)))
    q, k, v, cot = (randn((1, S, 4, 16), seed) for seed in (1, 2, 3, 4))  # (B, L, N, H)
    mask = create_block_mask(causal, 1, 1, S, S, device="cpu")
    compiled = torch.compile(fa.flex_attention, backend="aot_eager", fullgraph=True)
    with cpu_flex_grads(), _cplib_names() as api, rotate(method), \
            unittest.mock.patch.object(FlexAttention, "_compiled_flex_attn", compiled):
        full = [t.double().requires_grad_(True) for t in (q, k, v)]
        want = FlexAttention(FlexAttention.Config())(*full, attention_masks=mask)
        want.backward(cot.double())
        with torch.compiler.set_stance("force_eager"):
            (lq, lk, lv, lcot), local_mask = api.cp_shard(mesh, (q, k, v, cot), mask,
                                                          "headtail")
        module = parallelize_module(FlexAttention(FlexAttention.Config()), mesh,
                                    cplib._ContextParallel(seq_dim=1, attention_type=cplib.
                                                           _ContextParallel.AttentionType.FLEX))
        for t in (lq, lk, lv):
            t.requires_grad_(True)
        ring_bytes_received(reset=True)
        out = module(lq, lk, lv, attention_masks=local_mask)
        out.backward(lcot)
        (w_out, w_dq, w_dk, w_dv), _ = api.cp_shard(
            mesh, (want.detach(), *(t.grad for t in full)), None, "headtail")
    for name, got, exp in zip(("out", "dq", "dk", "dv"), (out, lq.grad, lk.grad, lv.grad),
                              (w_out, w_dq, w_dk, w_dv)):
        assert_close(got.detach().double(), exp, what=f"torchtitan {method}: {name}", **TOL)
    return ring_bytes_received()


@pytest.mark.parametrize("method", ["p2p", "allgather"])
def test_torchtitan_flex_attention_module(ranks, method):
    received = ranks(2).run(_check_torchtitan_flex, method)
    assert all((r > 0) == (method == "p2p") for r in received), received
