"""transformers' model classes, as the installs that guard them find them:
the modules imported so far (the router losses, hf_loss.py), each model
class once (hf_pooled.py, hf_own_loss.py), and a class's ``forward``
behind a guard."""

from __future__ import annotations

import functools
import sys
import threading
import types
from typing import Any, Callable

__all__ = ["model_modules", "NewModelClasses", "guard_forward"]


def model_modules() -> list[tuple[str, types.ModuleType]]:
    """(name, module) of transformers' model modules imported so far."""
    return [(name, m) for name, m in list(sys.modules.items())
            if name.startswith("transformers.models.") and m is not None]


class NewModelClasses:
    """Visits the ``PreTrainedModel`` subclasses of the model modules
    imported since the last visit, by the name their module gives them."""

    def __init__(self) -> None:
        self._scanned: set[str] = set()
        # Threaded ranks start their contexts at once: no rank may run a model
        # before the rank visiting its class has guarded it.
        self._lock = threading.Lock()

    def visit(self, fn: Callable[[str, type], None]) -> None:
        from transformers.modeling_utils import PreTrainedModel

        with self._lock:
            for module_name, module in model_modules():
                if module_name in self._scanned:
                    continue
                self._scanned.add(module_name)
                for name, cls in list(vars(module).items()):
                    if isinstance(cls, type) and issubclass(cls, PreTrainedModel):
                        fn(name, cls)


def guard_forward(cls: type, mark: str,
                  guard: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """``cls.forward`` (its own, or the one it inherits: Llama's classifiers'
    comes from a generic base) replaced, on ``cls`` alone, by
    ``guard(forward)``, once per ``mark`` (a subclass inheriting the guarded
    forward keeps it). The guarded forward keeps the original's name and
    signature (``__wrapped__``: Trainer reads the signature)."""
    forward = cls.forward
    if getattr(forward, mark, False):
        return
    guarded = functools.wraps(forward)(guard(forward))
    setattr(guarded, mark, True)
    cls.forward = guarded
