"""Hugging Face models that pool one token of the sequence
(``*ForSequenceClassification``, the image, video and audio classifiers
built the same way, and ``*ForMultipleChoice``), refused under context
parallelism instead of classifying another token.

Such a model picks one position of the whole sequence (the last one that is
not padding, or the first, [CLS]) and classifies it. Under context
parallelism each rank holds only its shard, so each picks a position of its
own shard: every rank gets logits, none the right ones, with or without
``labels=``. Their forward raises NotImplementedError while a layout is in
effect (the same on every rank), before the model computes anything
(forward_guard.py).
"""

from __future__ import annotations

import re

__all__ = ["pools_one_token", "pooled_refusal"]

# HF's names for its pooled heads (its LOSS_MAPPING keys, matched in the class name).
_POOLED = re.compile(r"For((Sequence|Image|Video|Audio)Classification|MultipleChoice)$")


def pools_one_token(cls: type) -> bool:
    return bool(_POOLED.search(cls.__name__))


def pooled_refusal(cls: type, where: str) -> NotImplementedError:
    return NotImplementedError(
        f"cplib: {cls.__name__} classifies one pooled token of the whole sequence, and "
        f"under {where} each rank holds only its shard of it, so each would classify a "
        "token of its own shard: run this model outside context parallelism")
