"""Activation checkpointing (``torch.utils.checkpoint``, reentrant or not)
of attention inside a ``cplib.context_parallel`` region, and inside an
``attention_window`` block outside context parallelism: the recomputation in
the backward runs through cplib's dispatch too, so the gradients are one
process's (cplib/frontend/mode_kept.py), whichever way autograd is started
(``loss.backward()``, ``torch.autograd.backward``, ``torch.autograd.grad``),
and compiled (the checkpoint's body traced through the dispatch too).

Before, on 2 gloo ranks (S = 32, fp64): the dispatch, popped while it
handled ``loss.backward()``, was missing from the stack autograd ran the
backward under, so the recomputation called plain SDPA over the shard: the
gradient of the query projection was off by 14.7 with ``use_reentrant=True``,
silently, and ``use_reentrant=False`` raised a CheckpointError (the
recomputed tensors were another op's).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import checkpoint

from harness import assert_close

TOL = dict(atol=1e-10, rtol=1e-10)  # float64


def _weights():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 32, 8, generator=g, dtype=torch.float64)
    w = torch.randn(8, 8, generator=g, dtype=torch.float64, requires_grad=True)
    return x, w


def _block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(x @ w, x, x, is_causal=True)


def _grad_of(loss: torch.Tensor, w: torch.Tensor, entry: str) -> torch.Tensor:
    if entry == "grad":
        return torch.autograd.grad(loss, [w])[0]
    if entry == "autograd.backward":
        torch.autograd.backward([loss])
    else:
        loss.backward()
    grad, w.grad = w.grad, None
    return grad


def _checkpointed_in_region(reentrant: bool, entry: str, old_torch: bool) -> int:
    import cplib.frontend.mode_kept as mode_kept

    saved = mode_kept.redispatch
    if old_torch:  # torch < 2.13's path: past autograd's torch-function check by hand
        mode_kept.redispatch = None
    try:
        return _checkpointed(reentrant, entry)
    finally:
        mode_kept.redispatch = saved


def _checkpointed_block(x: torch.Tensor, w: torch.Tensor, reentrant: bool) -> torch.Tensor:
    if reentrant:  # its input needs a gradient for the checkpoint to run a backward
        x = x * torch.ones((), dtype=x.dtype, requires_grad=True)
    return checkpoint(_block, x, w, use_reentrant=reentrant)


def _checkpointed(reentrant: bool, entry: str, compiled: bool = False) -> int:
    import cplib

    x, w = _weights()
    want = _grad_of(_block(x, w).pow(2).sum(), w, "backward")
    n = dist.get_world_size()
    run = (torch.compile(_checkpointed_block, backend="aot_eager") if compiled
           else _checkpointed_block)
    with cplib.context_parallel(DeviceMesh("cpu", list(range(n))), buffers=[x],
                                buffer_seq_dims=[2]):
        got = _grad_of(run(x, w, reentrant).pow(2).sum(), w, entry)
    dist.all_reduce(got)  # each rank's loss is its shard's part of the sum
    assert_close(got, want, what=f"dw, {reentrant=}, {entry}", **TOL)
    return 1


@pytest.mark.parametrize("world_size,old_torch", [(2, False), (4, False), (2, True)])
def test_checkpointed_attention_in_a_region_has_one_process_gradients(ranks, world_size,
                                                                      old_torch):
    cases = [(True, "backward"), (False, "backward"), (True, "autograd.backward"),
             (False, "grad")]
    for reentrant, entry in cases:
        assert ranks(world_size).run(_checkpointed_in_region, reentrant, entry, old_torch) == \
            [1] * world_size


def test_compiled_checkpointed_attention_in_a_region_has_one_process_gradients(ranks):
    """torch.compile traces the checkpoint as a higher-order op, which it
    hands to the region's dispatch; before, the dispatch, popped meanwhile,
    left the body to torch's SDPA on the shard: dW off by 21.8, silently.
    Now the checkpoint runs eagerly under the dispatch (a graph break)."""
    assert ranks(2).run(_checkpointed, False, "backward", True) == [1, 1]


def test_checkpointed_attention_in_an_attention_window_block():
    import cplib

    x, w = _weights()
    mask = torch.ones(32, 32, dtype=torch.bool).tril().triu(-5)  # (5, 0): 5 keys back
    want = F.scaled_dot_product_attention(x @ w, x, x, attn_mask=mask).pow(2).sum()
    want = torch.autograd.grad(want, [w])[0]
    compiled = torch.compile(_checkpointed_block, backend="aot_eager")
    with cplib.attention_window((5, 0)):
        for run, reentrant in ((_checkpointed_block, True), (_checkpointed_block, False),
                               (compiled, False)):
            run(x, w, reentrant).pow(2).sum().backward()
            assert_close(w.grad, want, what=f"dw, {reentrant=}, {run is compiled=}", **TOL)
            w.grad = None


def test_fullgraph_names_why_a_checkpoint_leaves_the_graph():
    """fullgraph=True cannot hold the checkpoint that runs eagerly under the
    dispatch: dynamo's error carries cplib's reason and what to do."""
    import cplib

    def block(x, w):  # its own code, which no other test compiled without fullgraph
        return checkpoint(_block, x, w, use_reentrant=False)

    x, w = _weights()
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    with cplib.attention_window((5, 0)), pytest.raises(torch._dynamo.exc.Unsupported) as raised:
        compiled(x, w)
    assert "compile without fullgraph=True" in str(raised.value), raised.value


def _backward_after_exit(reentrant: bool) -> str:
    import cplib

    x, w = _weights()
    n = dist.get_world_size()
    with cplib.context_parallel(DeviceMesh("cpu", list(range(n))), buffers=[x],
                                buffer_seq_dims=[2]):
        loss = _checkpointed_block(x, w, reentrant).pow(2).sum()
    try:
        loss.backward()  # recomputes the block's attention: outside the region now
    except NotImplementedError as exc:
        return "refused" if "after the region exited" in str(exc) else str(exc)
    return "ran on the shard"


def test_a_backward_that_recomputes_attention_after_the_region_raises(ranks):
    """Before, with use_reentrant=True, dW was off by 3.04 (and silently
    wrong without it too): the recomputation ran torch's SDPA on the shard."""
    for reentrant in (True, False):
        assert ranks(2).run(_backward_after_exit, reentrant) == ["refused"] * 2, reentrant


def _recomputable_flags() -> list[bool]:
    import cplib
    from torch.overrides import _get_current_function_mode_stack

    from cplib.frontend.sdpa_dispatch import CPDispatchMode

    x, w = _weights()
    ids = torch.zeros(1, 32, dtype=torch.long)
    n = dist.get_world_size()
    flags = []
    with cplib.context_parallel(DeviceMesh("cpu", list(range(n))), buffers=[x, ids],
                                buffer_seq_dims=[2, 1]):
        mode = next(m for m in _get_current_function_mode_stack()
                    if isinstance(m, CPDispatchMode))
        _block(x, w).sum().backward()
        flags.append(mode.recomputable)
        _checkpointed_block(x, w, False).sum().backward()
        flags.append(mode.recomputable)
    return flags


def test_a_region_with_buffers_keeps_its_dispatch_in_a_backward_only_after_a_checkpoint(ranks):
    """The region's own saved-tensor hooks (its buffers' shards) made every
    attention call look recomputable: every backward then kept the dispatch,
    a handler on every Python-level torch call of the backward."""
    assert ranks(2).run(_recomputable_flags) == [[False, True]] * 2
