"""What one run of tests/support/family_runs.py computes, on a built tiny
model of tests/support/family_cases.py: the batch, the loss, the flattened
gradients; one process (the references), inside ``cplib.context_parallel``
(switches a and b), and HF Trainer's training step on ``cplib.patch_torch()``
by hand (switch c; family_runs.py's docstring says what it keeps of
Trainer). Also what the report reads off a model: whether it is causal, and
how its attention is written."""

from __future__ import annotations

import inspect
import sys
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

import family_cases as fc

LAYOUTS = {"sequential": False, "head_tail": True}


def make_batch(family: str) -> dict[str, torch.Tensor]:
    """input_ids, labels (positions 1-5 ignored: the valid labels fall
    unevenly on the ranks) and position_ids, the same in every process."""
    shape = fc.input_shape(family)
    ids = torch.randint(fc.FIRST_ID, fc.LAST_ID, shape, generator=torch.Generator().manual_seed(3))
    labels = fc.labels_for(family, ids)
    labels[:, 1:6] = -100
    ids_labels = ids.clone()  # labels shaped as input_ids: cplib.loss.cross_entropy's
    ids_labels[:, 1:6] = -100
    pos = torch.arange(fc.SEQ).expand(shape[0], fc.SEQ).contiguous()
    return {"input_ids": ids, "labels": labels, "position_ids": pos, "ids_labels": ids_labels}


def takes(model, name: str) -> bool:
    return name in inspect.signature(model.forward).parameters


def loss_of(model, batch: dict[str, torch.Tensor], extra: dict | None = None,
            helper: bool = False) -> torch.Tensor:
    """The model's ``labels=`` loss; with ``helper``, or for a model without
    LM head (or without ``labels``): its logits (a text model's hidden
    states through ``text_head``) and ``cplib.loss.cross_entropy``, the loss
    docs/hf.md gives for a loss of your own (the plain mean outside context
    parallelism)."""
    import cplib

    kw: dict[str, Any] = {"input_ids": batch["input_ids"], **(extra or {})}
    for name in ("position_ids", "use_cache"):
        if takes(model, name):
            kw[name] = batch[name] if name in batch else False
    own = fc.has_lm_head(model) and takes(model, "labels") and not helper
    if own:
        kw["labels"] = batch["labels"]
    out = model(**kw)
    if own:
        if out.loss is None:
            raise RuntimeError(f"{type(model).__name__} returned no loss for labels=")
        return out.loss
    logits = out.logits if fc.has_lm_head(model) else out[0] @ fc.text_head(out[0].shape[-1])
    return cplib.loss.cross_entropy(logits, batch["ids_labels"])


def flat_grads(model) -> np.ndarray:
    parts = [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1)
             for p in model.parameters()]
    return torch.cat(parts).float().numpy() if parts else np.zeros(0, np.float32)


def one_process(model, batch: dict, train: bool = False, probe: dict | None = None,
                helper: bool = False) -> dict:
    """Loss and gradients in one process; ``train``: Trainer's step without
    context parallelism (train mode, the model called with Trainer's inputs
    alone: ``input_ids``, ``labels`` and ``num_items_in_batch`` where it
    takes it), what its step under context parallelism must reproduce;
    ``helper``: with ``cplib.loss.cross_entropy`` (loss_of); ``probe`` gets
    the model's features and causal error first."""
    if probe is not None:  # before the backward (which some families refuse in eval mode)
        probe["features"] = _features(model)
        probe["causal_error"] = _causal_error(model, batch)
    model.train(train)
    if train:
        accepts, num_items = trainer_count(model, batch["labels"])
        inputs = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
        out = model(**({**inputs, "num_items_in_batch": num_items} if accepts else inputs))
        loss = out["loss"] if isinstance(out, dict) else out[0]
    else:
        loss = loss_of(model, batch, helper=helper)
    loss.backward()
    return {"loss": float(loss.detach()), "grads": flat_grads(model)}


def _features(model) -> list[str]:
    """What the report groups failures by: how the family's attention is
    written and what its mask holds (read from the built model)."""
    config = model.config.get_text_config()
    source = "".join(open(m.__file__, encoding="utf-8").read() for m in {
        sys.modules[type(mod).__module__] for mod in model.modules()}
        if "transformers/models/" in (m.__file__ or ""))
    kinds = set(getattr(config, "layer_types", None) or [])
    found = {
        "interface": "ALL_ATTENTION_FUNCTIONS" in source,
        "no_sdpa": not getattr(model, "_supports_sdpa", False),
        "window": getattr(config, "sliding_window", None) is not None
        or "sliding_attention" in kinds,
        "chunks": getattr(config, "attention_chunk_size", None) is not None,
        "indexer": any("Indexer" in type(m).__name__ for m in model.modules()),
        "compressor": any("Compressor" in type(m).__name__ for m in model.modules()),
        "moe": any("Moe" in type(m).__name__ or "Expert" in type(m).__name__
                   for m in model.modules()),
        "mask_function": "mask_function" in source or "and_masks(" in source,
        "no_lm_head": not fc.has_lm_head(model),
        "no_position_ids": not takes(model, "position_ids"),
        # Causal only through its mask: a decoder self-attention built
        # with is_causal=False (BigBird-Pegasus' decoder).
        "self_attn_not_causal": any(name.endswith("self_attn") and m.is_causal is False
                                    for name, m in model.named_modules()
                                    if hasattr(m, "is_causal")),
    }
    return sorted(k for k, v in found.items() if v)


@torch.no_grad()
def _causal_error(model, batch: dict) -> float:
    """How much the earlier outputs move when the last token changes,
    relative to their size: 0 (up to rounding) for a causal model."""
    def outputs(ids):
        kw = {"input_ids": ids, "use_cache": False} if takes(model, "use_cache") else \
            {"input_ids": ids}
        out = model(**kw)
        return (out.logits if fc.has_lm_head(model) else out[0]).float()

    model.eval()
    ids = batch["input_ids"]
    other = ids.clone()
    other[..., -1] = fc.FIRST_ID + (other[..., -1] + 1 - fc.FIRST_ID) % (fc.LAST_ID - fc.FIRST_ID)
    a, b = outputs(ids), outputs(other)
    return float((a[..., :-1, :] - b[..., :-1, :]).abs().max() / a.abs().max().clamp_min(1e-30))


def in_region(family: str, layout: str,
              helper: bool = False) -> Callable[[Any], Callable[[Any], dict]]:
    """Switches a and b: ``mesh -> model -> outcome``, the model's loss and
    backward inside ``cplib.context_parallel`` with the batch as buffers."""
    def with_mesh(mesh):
        def body(model):
            import cplib

            batch = make_batch(family)
            buffers = [batch["input_ids"], batch["position_ids"], batch["labels"],
                       batch["ids_labels"]]
            with cplib.context_parallel(mesh, buffers=buffers,
                                        buffer_seq_dims=[buffers[0].dim() - 1, 1, 1, 1],
                                        load_balance=LAYOUTS[layout]):
                loss = loss_of(model, batch, helper=helper)
                loss.backward()
            return {"loss": float(loss.detach()), "grads": flat_grads(model)}
        return body
    return with_mesh


def trainer_like(family: str) -> Callable[[Any], Callable[[Any], dict]]:
    """Switch c: Trainer's training_step on cplib.patch_torch(), by hand
    (module docstring)."""
    return lambda mesh: lambda model: trainer_step(family, mesh, model)


def trainer_count(model, labels: torch.Tensor) -> tuple[bool, torch.Tensor]:
    """Trainer's ``model_accepts_loss_kwargs`` and ``num_items_in_batch``:
    the valid labels, from the second on where the model's loss shifts them
    (counted before sharding, gathered over the processes and divided by
    cp_size: the global count)."""
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    accepts = getattr(model, "accepts_loss_kwargs", None)
    if accepts is None:
        accepts = any(p.kind == inspect.Parameter.VAR_KEYWORD
                      for p in inspect.signature(model.forward).parameters.values())
    shifts = LOSS_MAPPING.get(getattr(model, "loss_type", None)) is ForCausalLMLoss and \
        not getattr(model.config, "is_encoder_decoder", False)
    return accepts, (labels[..., 1:] if shifts else labels).ne(-100).sum()


def trainer_step(family: str, mesh, model) -> dict:
    """Trainer.training_step with ParallelismConfig(cp_size=n) on
    cplib.patch_torch(), line by line: what accelerate's prepare() does to
    the model, what Trainer adds to the batch and lists as the region's
    buffers, the loss Trainer backpropagates (the gradient mean over the
    ranks is DDP's, taken by the report)."""
    import cplib
    from accelerate.big_modeling import _attach_context_parallel_hooks

    batch = make_batch(family)
    ids, labels = batch["input_ids"], batch["labels"]
    accepts, num_items = trainer_count(model, labels)
    # _prepare_context_parallel_inputs: shift_labels and position_ids added,
    # the four listed as the region's buffers.
    inputs = {"input_ids": ids, "labels": labels,
              "shift_labels": torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)],
                                        dim=1),
              "position_ids": batch["position_ids"]}
    buffers = list(inputs.values())
    cplib.patch_torch()
    try:
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import set_rotate_method

        set_rotate_method("allgather")  # accelerate's default cp_comm_strategy
        _attach_context_parallel_hooks(model)  # Accelerator.prepare(): may refuse the model
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1] * len(buffers),
                              no_restore_buffers=set(buffers)):
            model.train()
            out = model(**({**inputs, "num_items_in_batch": num_items} if accepts else inputs))
            loss = out["loss"] if isinstance(out, dict) else out[0]
            if accepts:  # compute_loss: average_tokens_across_devices
                loss = loss * dist.get_world_size()
            loss.backward()
        return {"loss": float(loss.detach()), "grads": flat_grads(model)}
    finally:
        cplib.unpatch_torch()
