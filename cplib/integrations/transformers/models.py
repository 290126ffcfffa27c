"""transformers' model classes as cplib's integration reaches them: the model
modules imported so far, the model classes of a module, a model's family,
and a class's ``forward`` replaced (through the patch registry, owner
:data:`OWNER`) by a guarded one."""

from __future__ import annotations

import functools
import sys
import types
from typing import Any, Callable

from ... import patch_registry as registry

__all__ = ["OWNER", "model_modules", "model_classes", "family_of", "guard_forward"]

# The registry's owner of everything cplib installs into transformers.
OWNER = "transformers"
_PREFIX = "transformers.models."


def model_modules() -> list[tuple[str, types.ModuleType]]:
    """(name, module) of transformers' model modules imported so far."""
    return [(name, m) for name, m in list(sys.modules.items())
            if name.startswith(_PREFIX) and m is not None]


def model_classes(module: types.ModuleType) -> list[type]:
    """The ``PreTrainedModel`` subclasses ``module`` defines."""
    from transformers.modeling_utils import PreTrainedModel

    return [cls for cls in list(vars(module).values())
            if isinstance(cls, type) and issubclass(cls, PreTrainedModel)
            and cls.__module__ == module.__name__]


def family_of(cls_or_module: Any) -> str | None:
    """The family (``transformers.models.<family>``) a class or module
    belongs to; None outside transformers' models (a model of the user's own,
    remote code)."""
    name = cls_or_module.__module__ if isinstance(cls_or_module, type) else \
        getattr(cls_or_module, "__name__", "")
    return name.split(".")[2] if name.startswith(_PREFIX) else None


def guard_forward(cls: type, guard: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """``cls.forward`` (its own, or the one it inherits: Llama's classifiers'
    comes from a generic base) replaced, on ``cls`` alone, by
    ``guard(forward)``, once. An inherited forward that is already guarded
    is guarded from its original, so that no call goes through two guards.
    The guarded forward keeps the original's name and signature
    (``__wrapped__``: Trainer reads the signature)."""

    def make(forward: Callable[..., Any]) -> Callable[..., Any]:
        forward = getattr(forward, "__cplib_unguarded__", forward)
        guarded = functools.wraps(forward)(guard(forward))
        guarded.__cplib_unguarded__ = forward  # type: ignore[attr-defined]
        return guarded

    registry.replace(OWNER, cls, "forward", make)
