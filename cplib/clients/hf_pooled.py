"""Hugging Face models that pool one token of the sequence
(``*ForSequenceClassification``, the image, video and audio classifiers
built the same way, and ``*ForMultipleChoice``), refused under context
parallelism instead of classifying another token.

Such a model picks one position of the whole sequence (the last one that is
not padding, or the first, [CLS]) and classifies it. Under context
parallelism each rank holds only its shard, so each picks a position of its
own shard: every rank gets logits, none the right ones, with or without
``labels=``. Their forward raises NotImplementedError while a layout is in
effect (cplib/frontend/sequence.py ``layout_source``: the same on every rank),
before the model computes anything. Installed, like the losses, whenever
cplib's context parallelism starts while transformers is imported
(on_start.py): each start wraps the classes imported since.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from ..frontend.sequence import layout_source
from .hf_models import NewModelClasses, guard_forward

__all__ = ["install_pooled_refusal"]

# HF's names for its pooled heads (its LOSS_MAPPING keys, matched in the class name).
_POOLED = re.compile(r"For((Sequence|Image|Video|Audio)Classification|MultipleChoice)$")
_new_classes = NewModelClasses()


def _refusing(forward: Callable[..., Any]) -> Callable[..., Any]:
    def pooled_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        where = layout_source()
        if where is not None:
            raise NotImplementedError(
                f"cplib: {type(self).__name__} classifies one pooled token of the whole "
                f"sequence, and under {where} each rank holds only its shard of it, so each "
                "would classify a token of its own shard: run this model outside context "
                "parallelism")
        return forward(self, *args, **kwargs)

    return pooled_forward


def install_pooled_refusal() -> None:
    """Guards the forward of every pooled model class of the transformers
    modules imported since the last install."""
    def refuse(name: str, cls: type) -> None:
        if _POOLED.search(name):
            guard_forward(cls, "_cplib_refuses_pooled", _refusing)

    _new_classes.visit(refuse)
