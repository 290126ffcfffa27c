"""Hugging Face models that compute their loss themselves, refused under
context parallelism when given labels, instead of returning a per-shard loss.

About 380 of transformers' model classes (BERT's, RoBERTa's and DeBERTa's
heads, DistilBERT's, T5's, ...) build an ``nn.CrossEntropyLoss`` of their own
rather than taking the model's ``loss_function``, which cplib makes exact
(hf_loss.py). Under context parallelism that loss is the mean over the
rank's shard, which no mean over the ranks turns into the model's loss. The
forward of every model class taking labels (``labels``, ``*_labels``,
``start_positions``, ...; not ``input_labels``, SAM's point prompts) is
guarded: given one under a layout, a forward that returned a loss without
asking for its ``loss_function`` raises NotImplementedError, on every rank
alike (the model's code decides), before any backward. The message points to
``cplib.loss.cross_entropy`` on the model's logits.

The forward has run when it raises (only running it tells how the loss was
taken); its collectives ran on every rank alike, so nothing hangs. Installed,
like the losses, whenever cplib's context parallelism starts while
transformers is imported (on_start.py), on the classes imported since.
"""

from __future__ import annotations

import inspect
import re
from typing import Any, Callable

import torch

from ..frontend.sequence import layout_source
from .hf_loss import loss_function_reads
from .hf_models import NewModelClasses, guard_forward

__all__ = ["install_own_loss_refusal"]

# Targets of a loss by HF's names for them; "input_labels" are prompts.
_TARGET = re.compile(r"^(?!input_)(labels|\w+_labels?|start_positions|end_positions)$")
_new_classes = NewModelClasses()


def _target_slots(forward: Callable[..., Any]) -> dict[str, int]:
    """The targets ``forward`` takes: name -> position among the arguments
    after ``self``."""
    try:
        params = list(inspect.signature(forward).parameters)
    except (TypeError, ValueError):  # a forward without a signature takes no named targets
        return {}
    return {name: i - 1 for i, name in enumerate(params) if _TARGET.match(name)}


def _returned_loss(out: Any) -> bool:
    """A ModelOutput with its ``loss``, or (``return_dict=False``) a tuple
    that HF opens with it."""
    if isinstance(out, tuple) and not hasattr(out, "loss"):
        return bool(out) and torch.is_tensor(out[0]) and out[0].dim() == 0
    return getattr(out, "loss", None) is not None


def _refusing_own_loss(forward: Callable[..., Any]) -> Callable[..., Any]:
    slots = _target_slots(forward)

    def forward_taking_loss_function(self: Any, *args: Any, **kwargs: Any) -> Any:
        where = layout_source()
        given = [name for name, i in slots.items()
                 if kwargs.get(name) is not None or (0 <= i < len(args) and args[i] is not None)]
        if where is None or not given:
            return forward(self, *args, **kwargs)
        asked = loss_function_reads()
        out = forward(self, *args, **kwargs)
        if loss_function_reads() == asked and _returned_loss(out):
            raise NotImplementedError(
                f"cplib: {type(self).__name__} computes its loss from {given[0]}= itself, not "
                f"through its loss_function, and under {where} that is the mean over this "
                "rank's shard alone: call it without labels and take the loss of its logits "
                "with cplib.loss.cross_entropy(logits, labels, shift=False) (shift=True for "
                "labels scored against the next token), which covers the whole sequence")
        return out

    return forward_taking_loss_function


def install_own_loss_refusal() -> None:
    """Guards the forward of every model class taking a loss target, of the
    transformers modules imported since the last install."""
    def refuse(_: str, cls: type) -> None:
        if _target_slots(cls.forward):
            guard_forward(cls, "_cplib_refuses_own_loss", _refusing_own_loss)

    _new_classes.visit(refuse)
