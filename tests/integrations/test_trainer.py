"""HF Trainer (transformers 5.23.0) with context parallelism
(``TrainingArguments(parallelism_config=ParallelismConfig(cp_size=2))``) on
cplib through ``cplib.patch_torch()``: one training step of a tiny Llama on 2
gloo ranks against one process. The mean over the ranks of the loss Trainer
backpropagates (after its own ``* num_processes``) and the gradients after its
reduction (DDP's mean) equal the one-process loss and gradients, for SDPA with
cplib's losses installed by the switch alone or by ``import cplib.hf`` too,
and for ``attn_implementation="cplib"``; and Trainer still sees
``ForCausalLMLoss`` in ``LOSS_MAPPING`` (it counts ``num_items_in_batch`` over
the shifted labels); with gradient checkpointing, eager and with Trainer
compiling the model (``torch_compile=True``, on aot_eager: dynamo's trace is
what is tested, in a third of inductor's time). Before cplib 0.1's clients
work, ``import cplib.hf`` gave twice the loss and gradients here. Before this
session's fixes, gradient checkpointing raised a CheckpointError (its
recomputation ran without cplib's dispatch: tests/frontend/
test_checkpoint_in_region.py); compiled, dynamo failed in cplib's loss
(TypeError: 'int' object is not subscriptable), and with that fixed the
compiled checkpointed layers ran torch's SDPA on the shard alone (the loss
off by 1.8e-3, silently: cplib/frontend/mode_kept.py body_with_mode)."""

from __future__ import annotations

import unittest.mock

import pytest

from client_cases import (accelerate_ranks, batch, check_against, one_process, tiny_llama,
                          trainer_step)

pytest.importorskip("accelerate", reason="requirements/clients.txt (make build installs it)")


def _through_trainers_sdpa_check(model, prepare):
    """Trainer refuses context parallelism unless the model's attention is
    "sdpa" (its limit, docs/clients.md): its check reads the config's name
    in ``_prepare_context_parallel_inputs``, which this wraps so that the
    check reads "sdpa" while the model runs its own ("cplib")."""
    real = model.config._attn_implementation

    def wrapped(*args, **kwargs):
        model.config._attn_implementation = "sdpa"
        try:
            return prepare(*args, **kwargs)
        finally:
            model.config._attn_implementation = real

    return wrapped


_OPTIONS = {"": {}, "checkpointed": dict(gradient_checkpointing=True),
            "compiled, checkpointed": dict(torch_compile=True, torch_compile_backend="aot_eager",
                                           gradient_checkpointing=True)}


def _trainer_step(attn: str, with_cplib_hf: bool, options: str) -> dict:
    import cplib
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    if with_cplib_hf:
        import cplib.hf  # noqa: F401
    cplib.patch_torch()
    try:
        with accelerate_ranks():
            assert LOSS_MAPPING["ForCausalLM"] is ForCausalLMLoss
            inputs = batch()
            model = tiny_llama(attn)
            want = one_process(model, inputs)
            loss, grads = trainer_step(
                model, inputs, None if attn == "sdpa" else
                lambda trainer: unittest.mock.patch.object(
                    trainer, "_prepare_context_parallel_inputs",
                    _through_trainers_sdpa_check(model, trainer._prepare_context_parallel_inputs)),
                **_OPTIONS[options])
            assert model.config._attn_implementation == attn
            return check_against(f"Trainer {attn} cplib.hf={with_cplib_hf} {options}", loss,
                                 grads, want)
    finally:
        cplib.unpatch_torch()


@pytest.mark.parametrize("attn,with_cplib_hf,options", [
    ("sdpa", False, ""), ("sdpa", True, ""), ("cplib", True, ""), ("sdpa", False, "checkpointed"),
    ("sdpa", False, "compiled, checkpointed")])
def test_trainer_step_equals_one_process(ranks, attn, with_cplib_hf, options):
    errors = ranks(2).run(_trainer_step, attn, with_cplib_hf, options)
    assert errors[0] == errors[1]
