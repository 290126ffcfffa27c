"""A hybrid model (tiny Qwen3-Next: Gated DeltaNet and attention layers, SDPA)
under context parallelism in processes that never import ``cplib.hf``: HF
Trainer through ``cplib.patch_torch()`` (the issue's one switch; with
gradient checkpointing, whose recomputation carries the state too), and a plain
``cplib.context_parallel`` region with a loss of the user's own
(``cplib.loss.cross_entropy``) or HF's (``labels=``). Either way the Gated DeltaNet layers carry
their conv halo and recurrent state across the 2 gloo ranks: the mean over
the ranks of the loss is one process's within 2e-5 relative and every
gradient within 1e-5 (issue 43's goals for hybrid models). Before, these
layers ran on each shard from a zero state and the loss missed by ~1e-3,
silently: only ``import cplib.hf`` intercepted them.

accelerate 1.15 (and so Trainer) refuses such a model in ``prepare()``
(its layer types are not all full attention): pinned here, then lifted
(client_cases.hybrid_layer_types_accepted) to run the step.

The ranks are a pool of their own (spawned for this file): the shared pool's
processes may have imported ``cplib.hf`` for other tests, which would hide a
switch that misses the hybrid layers."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from client_cases import (accelerate_ranks, batch, hybrid_layer_types_accepted, mean_over_ranks,
                          one_process, trainer_step)
from harness import RankPool, assert_close
from hybrid_cases import hybrid_block, tiny_config

pytest.importorskip("accelerate", reason="requirements/clients.txt (make build installs it)")

_pools: dict[str, RankPool] = {}


@pytest.fixture(scope="module")
def ranks_without_cplib_hf():
    """``run(fn, *args)`` on 2 ranks of this file's own pool (respawned after a failure)."""
    def run(fn, *args):
        pool = _pools.get("pool")
        if pool is None or not pool.alive():
            pool = _pools["pool"] = RankPool(2)
        return pool.run(fn, *args)

    yield run
    for pool in _pools.values():
        pool.close()
    _pools.clear()


def _qwen3_next():
    """Tiny Qwen3-Next on SDPA (1 Gated DeltaNet + 1 attention layer, GQA-style
    value heads), built without ``cplib.hf``; sharper logits, so that a wrong
    hidden state shows in the loss."""
    from transformers import Qwen3NextForCausalLM

    assert "cplib.hf" not in sys.modules, "this check needs a process without cplib.hf"
    config = tiny_config("qwen3_next", dict(linear_num_key_heads=2, linear_num_value_heads=4))
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen3NextForCausalLM(config).float().train()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8)
    return model


def _check(what: str, loss: torch.Tensor, grads: dict, want: tuple) -> float:
    want_loss, want_grads = want
    assert_close(mean_over_ranks(loss), want_loss, atol=0, rtol=2e-5, what=f"{what}: mean loss")
    for name, g in want_grads.items():
        assert_close(grads[name], g, atol=1e-5, rtol=0, what=f"{what}: gradient of {name}")
    assert "cplib.hf" not in sys.modules
    return abs(mean_over_ranks(loss).item() - want_loss.item())


def _trainer_with_the_switch() -> float:
    import cplib

    cplib.patch_torch()
    try:
        with accelerate_ranks():
            inputs = batch(s=32)
            model = _qwen3_next()
            want = one_process(model, inputs)
            with pytest.raises(ValueError, match="linear_attention"):  # accelerate's refusal
                trainer_step(model, inputs)
            # With gradient checkpointing, as such models train: the recomputation
            # in the backward carries the layers' state too.
            with hybrid_layer_types_accepted():
                loss, grads = trainer_step(model, inputs, gradient_checkpointing=True)
            return _check("Trainer, patch_torch, Qwen3-Next sdpa, checkpointed", loss, grads,
                          want)
    finally:
        cplib.unpatch_torch()


def test_trainer_with_patch_torch_carries_hybrid_layers(ranks_without_cplib_hf):
    errors = ranks_without_cplib_hf(_trainer_with_the_switch)
    assert errors[0] == errors[1]


def _plain_region(loss_kind: str) -> float:
    """Sequential, uneven shards (HF's SDPA mask for head-tail positions is a
    4-D one, which cplib's SDPA refuses: its own error, hf.md); the loss is
    cplib.loss.cross_entropy on the logits, or HF's own (``labels=``)."""
    import cplib

    n = dist.get_world_size()
    inputs = batch(s=33)
    model = _qwen3_next()
    want = one_process(model, inputs)
    ids, pos, labels = (inputs[k].clone() for k in ("input_ids", "position_ids", "labels"))
    with cplib.context_parallel(DeviceMesh("cpu", list(range(n))), buffers=[ids, pos, labels],
                                buffer_seq_dims=[1, 1, 1], load_balance=False):
        if loss_kind == "labels=":
            loss = model(input_ids=ids, position_ids=pos, labels=labels, use_cache=False).loss
        else:
            logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
            loss = cplib.loss.cross_entropy(logits, labels)
        loss.backward()
    grads = {name: mean_over_ranks(p.grad) for name, p in model.named_parameters()}
    return _check(f"cplib.context_parallel, {loss_kind}", loss, grads, want)


@pytest.mark.parametrize("loss_kind", ["cplib.loss.cross_entropy", "labels="])
def test_context_parallel_without_cplib_hf_carries_hybrid_layers(ranks_without_cplib_hf,
                                                                 loss_kind):
    """With ``labels=`` the region's start installs cplib's causal-LM loss
    (HF's shifts inside each shard and averages per shard: the mean over the
    ranks missed one process's, silently)."""
    errors = ranks_without_cplib_hf(_plain_region, loss_kind)
    assert errors[0] == errors[1]


def _own_model_in_a_region() -> int:
    """A model of the user's own holding transformers' Gated DeltaNet layer,
    head-tail shards: output and every parameter's gradient."""
    import cplib

    assert "cplib.hf" not in sys.modules
    n = dist.get_world_size()
    ref = hybrid_block("qwen3_next", "Qwen3NextGatedDeltaNet")
    model = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(2, 32, 32, generator=g), torch.randn(2, 32, 32, generator=g)
    want = ref(x)
    (want * w).sum().backward()
    lx, lw = x.clone(), w.clone()
    with cplib.context_parallel(DeviceMesh("cpu", list(range(n))), buffers=[lx, lw],
                                buffer_seq_dims=[1, 1], load_balance=True) as cp:
        out = model(lx)
        (out * lw).sum().backward()
        (got,) = cp.unshard([out.detach()], [1])
    assert_close(got, want.detach(), atol=2e-5, rtol=1e-5, what="own model: output")
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad)  # each rank's gradient of its shard's part of the sum
        assert_close(grad, dict(ref.named_parameters())[name].grad, atol=1e-5, rtol=1e-5,
                     what=f"own model: gradient of {name}")
    return 1


def test_own_model_with_a_hybrid_layer_in_a_region(ranks_without_cplib_hf):
    assert ranks_without_cplib_hf(_own_model_in_a_region) == [1, 1]


def test_integrations_never_import_cplib_hf():
    """``cplib.hf``'s import is the ``attn_implementation="cplib"`` switch;
    what ``patch_torch()`` and the context's start install lives in
    cplib/integrations/, which ``cplib.hf`` imports, never the reverse."""
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location(
        "import_cycles", os.path.join(root, "build_support", "import_cycles.py"))
    cycles = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cycles)
    graph = cycles.import_graph(os.path.join(root, "cplib"), "cplib")
    upward = [(m, t) for m, targets in graph.items() if m.startswith("cplib.integrations")
              for t in targets if t == "cplib.hf" or t.startswith("cplib.hf.")]
    assert upward == []
