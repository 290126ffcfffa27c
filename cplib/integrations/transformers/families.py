"""Every family of the pinned transformers' models, classified (DESIGN.md
section 15): exact under context parallelism, or refused by name.

The classification (family_verdicts.py) comes from a test that builds a tiny
instance of every family and runs it under each switch against one process
(tests/integrations/test_every_family.py): a family is exact there, or
refused here with the layer that cannot run and what would work; a family
that no one classified (a new transformers release) is refused too, so none
runs a silent path. A family is a package of ``transformers.models``; a
model of one's own (another module) is not classified.

Where it is read:

* under context parallelism, at the start of every model's forward
  (forward_guard.py): the verdict for the model's attention implementation,
  on every rank alike (the config decides) and before any collective;
  implementations that attend within the shard (eager, flash) are refused
  for every family that has attention layers;
* when ``attn_implementation="cplib"`` is set (``from_config``,
  ``set_attn_implementation``): refused for the families whose layers cannot
  run it even in one process;
* by ``cplib_mask``: whether a family's layers carry what transformers'
  mask function says (windows, chunks), so that the mask may be left unbuilt.
"""

from __future__ import annotations

from typing import Any, Callable

from .family_verdicts import FAMILIES, Refusal, Verdict
from .models import family_of

__all__ = ["check_family", "guarded_attn_implementation", "verdict_of", "FAMILIES"]

# What cplib routes under context parallelism; any other implementation
# attends within this rank's shard.
_ROUTED = ("sdpa", "cplib", "flex_attention")
_UNCLASSIFIED = Refusal(
    "its layers", "belong to a family that cplib has not classified (cplib classifies every "
    "family of the transformers release it pins, requirements-dev.txt)",
    "run it without context parallelism, or classify the family: "
    "tests/integrations/test_every_family.py")


def verdict_of(cls: type) -> tuple[str | None, Verdict | None]:
    """(family, its verdict); (None, None) outside transformers' models;
    (family, None) for a family no one classified."""
    family = family_of(cls)
    return family, None if family is None else FAMILIES.get(family)


def _raise(refusal: Refusal, cls: type, family: str, where: str) -> None:
    raise NotImplementedError(
        f"cplib: {cls.__name__} ({family}): {refusal.layer} {refusal.reason}, so under "
        f"{where} it would not compute what one process computes; {refusal.instead}")


def check_family(cls: type, config: Any, where: str) -> None:
    """NotImplementedError naming the family, the layer and what would work,
    unless ``cls``'s family runs exactly under ``where`` with the config's
    attention implementation."""
    family, verdict = verdict_of(cls)
    if family is None:
        return
    if verdict is None:
        _raise(_UNCLASSIFIED, cls, family, where)
    impl = getattr(config, "_attn_implementation", None) or "sdpa"
    if impl not in _ROUTED and not verdict.attention_free:
        _raise(Refusal(f"its attention (attn_implementation={impl!r})",
                       "attends from this rank's queries to this rank's keys alone",
                       'use attn_implementation="sdpa", or "cplib" (import cplib.hf)'),
               cls, family, where)
    refusal = verdict.cplib if impl == "cplib" else verdict.sdpa
    if refusal is not None and refusal.applies_to(config):
        _raise(refusal, cls, family, where)


def _requests_cplib(requested: Any) -> bool:
    if isinstance(requested, dict):
        return any(_requests_cplib(v) for v in requested.values())
    return requested == "cplib"


def guarded_attn_implementation(original: Callable[..., str]) -> Callable[..., str]:
    """``PreTrainedModel.get_correct_attn_implementation``, refusing
    ``"cplib"`` for the families that cannot run it even in one process (and
    for families no one classified): raised when the model is built with it
    or switched to it."""

    def get_correct_attn_implementation(self: Any, requested_attention: Any = None,
                                        *args: Any, **kwargs: Any) -> str:
        if _requests_cplib(requested_attention):
            family, verdict = verdict_of(type(self))
            refusal = _UNCLASSIFIED if family is not None and verdict is None else \
                None if verdict is None else verdict.settable
            if refusal is not None and refusal.applies_to(getattr(self, "config", None)):
                raise NotImplementedError(
                    f"cplib: attn_implementation=\"cplib\" cannot run {type(self).__name__} "
                    f"({family}): {refusal.layer} {refusal.reason}; {refusal.instead}")
        return original(self, requested_attention, *args, **kwargs)

    return get_correct_attn_implementation
