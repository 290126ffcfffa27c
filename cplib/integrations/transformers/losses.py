"""Hugging Face's losses under context parallelism: the causal-LM,
masked-LM, token-classification and MoE router losses, installed with the
rest of the integration (__init__.py; docs/integrations.md): ``labels=``
under a plain ``cplib.context_parallel`` region is never a per-shard loss.

HF's ``ForCausalLMLoss`` shifts ``labels`` inside the tensor it gets and
averages over the valid tokens it sees: on a shard, both are wrong (the
masked-LM and token-classification losses only average). Under context
parallelism (a ``cplib.context_parallel`` region, a model's forward given
shards of ``_context_parallel_shard``, or labels that are such a shard:
cplib/frontend/sequence.py) the installed loss
shifts causal-LM labels over the whole sequence (``shift_labels``, already
shifted, are taken as given; the other two score each position against its
own label) and returns

* ``N * (this rank's token losses) / (global count of valid labels)``
  without ``num_items_in_batch``: the mean over the N CP ranks of the loss,
  and of the parameter gradients, is the one-process value;
* ``(this rank's token losses) / num_items_in_batch`` with it: Hugging
  Face's convention for that argument (the caller multiplies by its number
  of processes, as Trainer does), so nothing is scaled twice.

Every other loss of HF's ``LOSS_MAPPING`` (sequence classification, question
answering, CTC, detection, ...) reads the whole sequence at once and raises
NotImplementedError under context parallelism.

The models' ``loss_function`` returns these where Hugging Face maps the model
to its loss (``LOSS_MAPPING`` itself is left alone: Trainer's
``LOSS_MAPPING[...] is ForCausalLMLoss`` check, which decides how it counts
``num_items_in_batch``, still holds). Outside context parallelism each loss is
HF's own.
"""

from __future__ import annotations

import functools
import threading
import types
from typing import Any, Callable

import torch

from ... import patch_registry as registry
from ...frontend.sequence import (labels_in_layout, layout_source, sequence_shards, shards_of,
                                  traced_on_the_module_path)
from ...loss import shifted, token_loss_sum
from .models import OWNER
from .router_loss import caller_scales, context_parallel_router_loss

__all__ = ["install_losses", "wrap_router_loss", "context_parallel_causal_lm_loss",
           "context_parallel_masked_lm_loss", "context_parallel_token_classification_loss",
           "refused_under_context_parallelism", "loss_function_reads"]


def _sharded(logits: torch.Tensor, labels: Any) -> bool:
    """Whether a loss of ``logits`` against ``labels`` is under context
    parallelism: a scope is open, or the labels carry the layout they were
    cut in (cplib/frontend/sequence.py)."""
    traced_on_the_module_path("a Hugging Face loss")
    return sequence_shards(logits.shape[-2]) is not None or shards_of(labels) is not None


def _whole_sequence_loss(logits: torch.Tensor, given: torch.Tensor, what: str, shift: bool,
                         num_items_in_batch: Any, ignore_index: int) -> torch.Tensor:
    """This rank's share of a token-wise cross-entropy over the whole
    sequence (the module docstring's convention); ``shift``: ``given`` are
    HF's causal-LM labels, scored against the next token."""
    logits = logits.float()  # as HF computes it
    shards, full = labels_in_layout(logits, given, what)
    target = shifted(full, ignore_index) if shift else full
    total, count = token_loss_sum(shards, logits, target, ignore_index)
    if num_items_in_batch is None:
        return total * shards.mesh.size() / count
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def context_parallel_causal_lm_loss(original: Callable[..., torch.Tensor], logits: torch.Tensor,
                                    labels: torch.Tensor | None, vocab_size: int,
                                    num_items_in_batch: Any = None, ignore_index: int = -100,
                                    shift_labels: torch.Tensor | None = None,
                                    **kwargs: Any) -> torch.Tensor:
    """HF's causal-LM loss (``original``) without context parallelism; with
    it, the loss of the module docstring."""
    caller_scales.set(num_items_in_batch is not None)
    given, what = (labels, "labels") if shift_labels is None else (shift_labels, "shift_labels")
    if not _sharded(logits, given):
        return original(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                        ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
    return _whole_sequence_loss(logits, given, what, shift_labels is None, num_items_in_batch,
                                ignore_index)


def context_parallel_masked_lm_loss(original: Callable[..., torch.Tensor], logits: torch.Tensor,
                                    labels: torch.Tensor, vocab_size: int,
                                    num_items_in_batch: Any = None, ignore_index: int = -100,
                                    **kwargs: Any) -> torch.Tensor:
    """HF's masked-LM loss (``original``) without context parallelism; with
    it, each position scored against its own label over the whole sequence."""
    caller_scales.set(num_items_in_batch is not None)
    if not _sharded(logits, labels):
        return original(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                        ignore_index=ignore_index, **kwargs)
    return _whole_sequence_loss(logits, labels, "labels", False, num_items_in_batch, ignore_index)


def context_parallel_token_classification_loss(original: Callable[..., torch.Tensor],
                                               logits: torch.Tensor, labels: torch.Tensor,
                                               config: Any, **kwargs: Any) -> torch.Tensor:
    """HF's token-classification loss (``original``) without context
    parallelism; with it, as the masked-LM loss (``num_items_in_batch`` and
    ``ignore_index`` come in ``kwargs``, as HF passes them)."""
    num_items = kwargs.get("num_items_in_batch")
    caller_scales.set(num_items is not None)
    if not _sharded(logits, labels):
        return original(logits, labels, config, **kwargs)
    return _whole_sequence_loss(logits, labels, "labels", False, num_items,
                                kwargs.get("ignore_index", -100))


def refused_under_context_parallelism(original: Callable[..., Any]) -> Callable[..., Any]:
    """HF's ``original`` loss outside context parallelism; under it, a
    NotImplementedError naming it (the same on every rank: the layout and the
    model decide). These losses read a whole sequence at once (a pooled
    token, start and end over all positions, an alignment), which no rank
    holds."""

    @functools.wraps(original)
    def loss(*args: Any, **kwargs: Any) -> Any:
        where = layout_source()
        if where is not None:
            raise NotImplementedError(
                f"cplib: Hugging Face's {original.__name__} reads the whole sequence at once, "
                f"and under {where} each rank holds only its shard of it, so the loss would "
                "be another one; cplib computes the causal-LM, masked-LM and "
                "token-classification losses over the whole sequence: compute this one "
                "outside context parallelism")
        return original(*args, **kwargs)

    return loss


# How many times this thread (a rank) has asked a model for its loss_function:
# forward_guard.py tells a model that takes its loss through it from one that
# computes its own.
_asked = threading.local()


def loss_function_reads() -> int:
    """How many times this thread has read a model's ``loss_function``."""
    return getattr(_asked, "count", 0)


def wrap_router_loss(module: types.ModuleType) -> None:
    """``module.load_balancing_loss_func`` (an MoE model's modeling module)
    through context_parallel_router_loss, once."""
    if callable(getattr(module, "load_balancing_loss_func", None)):
        registry.replace(OWNER, module, "load_balancing_loss_func",
                         lambda fn: functools.wraps(fn)(
                             functools.partial(context_parallel_router_loss, fn)))


def install_losses() -> None:
    """HF's losses, as models' ``loss_function`` returns them, through the
    ones of the module docstring (once)."""
    from transformers.loss import loss_utils
    from transformers.modeling_utils import PreTrainedModel

    exact = {loss_utils.ForCausalLMLoss: context_parallel_causal_lm_loss,
             loss_utils.ForMaskedLMLoss: context_parallel_masked_lm_loss,
             loss_utils.ForTokenClassification: context_parallel_token_classification_loss}
    # Each of HF's losses once, so that a model's loss_function is one object.
    installed = {fn: functools.wraps(fn)(functools.partial(exact[fn], fn)) if fn in exact
                 else refused_under_context_parallelism(fn)
                 for fn in set(loss_utils.LOSS_MAPPING.values())}

    def make(mapped: property) -> property:
        def loss_function(self: Any) -> Callable[..., Any]:
            _asked.count = loss_function_reads() + 1
            fn = mapped.fget(self)
            # A loss the user set on the model (model.loss_function = f) is theirs.
            if "_loss_function" in vars(self):
                return fn
            return installed.get(fn, fn)

        return property(loss_function, mapped.fset)

    registry.replace(OWNER, PreTrainedModel, "loss_function", make)
