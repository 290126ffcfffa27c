"""Hugging Face models that compute their loss themselves, refused under
context parallelism when given labels, instead of returning a per-shard loss.

About 380 of transformers' model classes (BERT's, RoBERTa's and DeBERTa's
heads, DistilBERT's, T5's, ...) build an ``nn.CrossEntropyLoss`` of their own
rather than taking the model's ``loss_function``, which cplib makes exact
(losses.py). Under context parallelism that loss is the mean over the rank's
shard, which no mean over the ranks turns into the model's loss. Given a
target (``labels``, ``*_labels``, ``start_positions``, ...; not
``input_labels``, SAM's point prompts) under a layout, a forward that
returned a loss without asking for its ``loss_function`` raises
NotImplementedError, on every rank alike (the model's code decides), before
any backward (forward_guard.py). The message points to
``cplib.loss.cross_entropy`` on the model's logits.

The forward has run when it raises (only running it tells how the loss was
taken); its collectives ran on every rank alike, so nothing hangs.
"""

from __future__ import annotations

import inspect
import re
from typing import Any, Callable

import torch

__all__ = ["target_slots", "given_targets", "returned_loss", "own_loss_refusal"]

# Targets of a loss by HF's names for them; "input_labels" are prompts.
_TARGET = re.compile(r"^(?!input_)(labels|\w+_labels?|start_positions|end_positions)$")


def target_slots(forward: Callable[..., Any]) -> dict[str, int]:
    """The targets ``forward`` takes: name -> position among the arguments
    after ``self``."""
    try:
        params = list(inspect.signature(forward).parameters)
    except (TypeError, ValueError):  # a forward without a signature takes no named targets
        return {}
    return {name: i - 1 for i, name in enumerate(params) if _TARGET.match(name)}


def given_targets(slots: dict[str, int], args: tuple, kwargs: dict) -> list[str]:
    return [name for name, i in slots.items()
            if kwargs.get(name) is not None or (0 <= i < len(args) and args[i] is not None)]


def returned_loss(out: Any) -> bool:
    """A ModelOutput with its ``loss``, or (``return_dict=False``) a tuple
    that HF opens with it."""
    if isinstance(out, tuple) and not hasattr(out, "loss"):
        return bool(out) and torch.is_tensor(out[0]) and out[0].dim() == 0
    return getattr(out, "loss", None) is not None


def own_loss_refusal(cls: type, target: str, where: str) -> NotImplementedError:
    return NotImplementedError(
        f"cplib: {cls.__name__} computes its loss from {target}= itself, not through its "
        f"loss_function, and under {where} that is the mean over this rank's shard alone: "
        "call it without labels and take the loss of its logits with "
        "cplib.loss.cross_entropy(logits, labels, shift=False) (shift=True for labels scored "
        "against the next token), which covers the whole sequence")
