"""What runs each time cplib's context parallelism starts: a
``cplib.context_parallel`` region is entered, ``_context_parallel_shard``
cuts a batch, or ``_ContextParallel`` parallelizes a module.

cplib/__init__.py registers here the one thing that must be in place by
then and lives above the front end: the integrations' install
(cplib/integrations/: cplib's interception of transformers, whichever
switch the user turned on, or none), which the front end cannot import
without an import running up the layers. A hook does local work only (no
collective), the same on every rank.
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
