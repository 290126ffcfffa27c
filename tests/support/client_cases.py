"""What the client tests (tests/integrations/) share: the tiny models and batch
(a Llama of 2 layers, hidden 64; a third of one row's labels -100), the
one-process reference, the comparison of the CP ranks' mean against it, and
the work-arounds for what the clients refuse on CPU (accelerate's
``MULTI_CPU`` check, Trainer's SDPA-only check), each undone on exit."""

from __future__ import annotations

import contextlib
import copy
import os
import tempfile
import unittest.mock

import torch
import torch.distributed as dist
import torch.nn.functional as F

VOCAB = 64
# The issue's goals (fp32): the CP ranks' mean against one process.
LOSS_TOL = 2e-5
GRAD_TOL = 1e-6


def tiny_llama(attn: str = "sdpa"):
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, attn_implementation=attn)
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(cfg)


def tiny_mixtral(attn: str = "sdpa"):
    import transformers as tf

    cfg = tf.MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=4, num_experts_per_tok=2,
                           output_router_logits=True, router_aux_loss_coef=4.0,
                           max_position_embeddings=512, attn_implementation=attn)
    torch.manual_seed(0)
    return tf.MixtralForCausalLM(cfg)


def batch(s: int = 64, rows: int = 2) -> dict[str, torch.Tensor]:
    """input_ids, labels (a third of row 0's are -100, so the valid tokens
    fall unevenly on the ranks), position_ids and Trainer-style shift_labels."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (rows, s), generator=g)
    labels = ids.clone()
    labels[0, 1:s // 3] = -100
    return {"input_ids": ids, "labels": labels,
            "position_ids": torch.arange(s).expand(rows, s).contiguous(),
            "shift_labels": F.pad(labels[:, 1:], (0, 1), value=-100)}


def one_process(model, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
    """The loss and every parameter gradient of ``model`` (a copy) on the whole batch."""
    ref = copy.deepcopy(model)
    loss = ref(input_ids=inputs["input_ids"], labels=inputs["labels"],
               position_ids=inputs["position_ids"], use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in ref.named_parameters()}


def mean_over_ranks(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().clone()
    dist.all_reduce(t)
    return t / dist.get_world_size()


def check_against(what: str, loss: torch.Tensor, grads: dict, want: tuple) -> dict:
    """The CP ranks' mean loss and the given gradients (already reduced by the
    client, or to be averaged here when ``grads`` are per rank) against the
    one-process ``want``; returns the errors."""
    want_loss, want_grads = want
    loss_err = abs(mean_over_ranks(loss).item() - want_loss.item())
    grad_err = max((grads[n] - g).abs().max().item() for n, g in want_grads.items())
    assert loss_err <= LOSS_TOL, f"{what}: mean loss off by {loss_err:.3g}"
    assert grad_err <= GRAD_TOL, f"{what}: gradients off by {grad_err:.3g}"
    return {"loss": loss_err, "grad": grad_err}


def mean_grads(model) -> dict:
    out = {}
    for n, p in model.named_parameters():
        out[n.removeprefix("module.")] = mean_over_ranks(p.grad)
    return out


def assert_rank_mean(what: str, model, loss: torch.Tensor, want: tuple, scale: int = 1,
                     **tol) -> None:
    """The CP ranks' mean loss and mean parameter gradients, times ``scale``
    (the process count where the caller scales, as with num_items_in_batch),
    against the one-process ``want`` (loss, gradients), element by element."""
    from harness import assert_close

    want_loss, want_grads = want
    assert_close(mean_over_ranks(loss) * scale, want_loss, what=f"{what}: mean loss", **tol)
    for name, g in mean_grads(model).items():
        assert_close(g * scale, want_grads[name], what=f"{what}: mean grad of {name}", **tol)


@contextlib.contextmanager
def accelerate_ranks():
    """This rank process as a launcher would set it up for accelerate (the
    environment it exports); accelerate's process-wide state reset on exit."""
    from accelerate.state import AcceleratorState

    env = {"RANK": str(dist.get_rank()), "LOCAL_RANK": str(dist.get_rank()),
           "WORLD_SIZE": str(dist.get_world_size()),
           "LOCAL_WORLD_SIZE": str(dist.get_world_size())}
    try:
        with unittest.mock.patch.dict(os.environ, env):
            yield
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


@contextlib.contextmanager
def cpu_parallelism_accepted():
    """accelerate refuses a ParallelismConfig unless the processes run on
    GPU-like devices (``Accelerator.multi_device`` leaves out ``MULTI_CPU``):
    the client's limit, which docs/clients.md states. Lifted while an
    Accelerator (or a Trainer, which builds one) is constructed; nothing
    else reads it."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    multi_device = Accelerator.multi_device

    def accepts_cpu(self):
        return multi_device.fget(self) or self.distributed_type == DistributedType.MULTI_CPU

    with unittest.mock.patch.object(Accelerator, "multi_device", property(accepts_cpu)):
        yield


@contextlib.contextmanager
def hybrid_layer_types_accepted():
    """accelerate 1.15 refuses context parallelism (in ``prepare()``, with a
    ValueError) for a model whose config lists layer types other than
    ``"full_attention"``: its hooks drop the attention mask, which would
    train sliding-window layers as full ones. Every hybrid family but RWKV and
    xLSTM lists such types (``"linear_attention"``, ``"conv"``, ...): the
    client's limit, which docs/clients.md states. Lifted while accelerate
    attaches its hooks, to show what cplib does where a client lets such a
    model through."""
    import accelerate.accelerator as accelerator

    attach = accelerator._attach_context_parallel_hooks

    def without_the_layer_type_check(model):
        config = model.config.get_text_config()
        layer_types, config.layer_types = config.layer_types, None
        try:
            return attach(model)
        finally:
            config.layer_types = layer_types

    with unittest.mock.patch.object(accelerator, "_attach_context_parallel_hooks",
                                    without_the_layer_type_check):
        yield


class Rows(torch.utils.data.Dataset):
    """A batch's rows (input_ids, labels) as Trainer's dataset."""

    def __init__(self, inputs: dict[str, torch.Tensor]) -> None:
        self.rows = [{"input_ids": i, "labels": l}
                     for i, l in zip(inputs["input_ids"], inputs["labels"])]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.rows[i]


def trainer_step(model, inputs: dict[str, torch.Tensor], patch_trainer=None,
                 cp_size: int = 2, **training_args) -> tuple[torch.Tensor, dict]:
    """One HF Trainer step of ``model`` on ``inputs`` with context parallelism
    (``parallelism_config=ParallelismConfig(cp_size=...)``, learning rate 0,
    and ``training_args``): the loss Trainer backpropagates and the gradients
    after its reduction (before the optimizer). ``patch_trainer(trainer)``, a
    context manager, wraps the step."""
    from accelerate.utils import ParallelismConfig
    from transformers import Trainer, TrainerCallback, TrainingArguments

    grads: dict[str, torch.Tensor] = {}

    class KeepGrads(TrainerCallback):  # after DDP's reduction, before the optimizer
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            grads.update({n.removeprefix("module."): p.grad.clone()
                          for n, p in model.named_parameters()})

    args = TrainingArguments(
        output_dir=scratch_dir(), per_device_train_batch_size=inputs["input_ids"].shape[0],
        max_steps=1, learning_rate=0.0, max_grad_norm=0.0, use_cpu=True, report_to=[],
        save_strategy="no", logging_strategy="no", disable_tqdm=True,
        parallelism_config=ParallelismConfig(cp_size=cp_size), **training_args)
    with cpu_parallelism_accepted():
        trainer = Trainer(model=model, args=args, train_dataset=Rows(inputs),
                          callbacks=[KeepGrads()])
    assert trainer._loss_shifts_labels, "Trainer no longer sees ForCausalLMLoss"
    losses = []
    step = trainer.training_step
    trainer.training_step = lambda *a, **kw: losses.append(step(*a, **kw)) or losses[-1]
    with (patch_trainer(trainer) if patch_trainer is not None else contextlib.nullcontext()):
        trainer.train()
    (loss,) = losses
    return loss, grads


def scratch_dir() -> str:
    return tempfile.mkdtemp(prefix="cplib-clients-")
