"""What runs each time cplib's context parallelism starts: a
``cplib.context_parallel`` region is entered, ``_context_parallel_shard``
cuts a batch, or ``_ContextParallel`` parallelizes a module.

The layers above the front end register here (cplib/__init__.py) what must
be in place by then, without the front end importing them: cplib's
interception of transformers (cplib/clients/on_start.py: its hybrid layers
carried across the ranks or refused, its losses over the whole sequence, its
shard-local attention paths refused), whichever switch (``import cplib.hf``,
``cplib.patch_torch()``, or none) the user turned on.
A hook does local work only (no collective), the same on every rank.
"""

from __future__ import annotations

from typing import Callable

__all__ = ["on_context_parallel_start", "run_start_hooks"]

_hooks: list[Callable[[], None]] = []


def on_context_parallel_start(hook: Callable[[], None]) -> None:
    """Runs ``hook()`` whenever context parallelism starts (once per hook)."""
    if hook not in _hooks:
        _hooks.append(hook)


def run_start_hooks() -> None:
    for hook in tuple(_hooks):
        hook()
