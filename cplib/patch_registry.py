"""The one registry of everything cplib replaces in code it does not own.

cplib reaches into torch (its context-parallel names, DTensor's op handlers)
and transformers (its attention lookup, losses, hybrid kernels, model
forwards). Each replacement goes through :func:`replace`, which records the
owner (the switch that installed it), the target (a module, a class or a
dict of another library), the name and the original, under one lock; so
:func:`restore` can put every original back, for one owner or for all, and
:func:`patches` lists what is installed (docs/integrations.md has the table
of owners and the points that install them).

What is recorded as the original is what the target itself held: for a
class that inherited the attribute, nothing (:data:`MISSING`), so restoring
deletes the replacement and the inherited one shows again. The replacement
is made from the attribute as the target resolves it (inherited included).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["MISSING", "Patch", "lock", "replace", "replaced", "original", "patches", "restore"]


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()  # the target held nothing under that name

# Installs happen from rank threads at once (a threaded process group): one
# lock for every install and restore; reentrant, since an install may build
# its replacements from others (a model class guarded while its module's
# kernels are wrapped).
_lock = threading.RLock()


@dataclass(frozen=True)
class Patch:
    owner: str  # the switch that installed it (docs/integrations.md)
    target: Any  # a module, a class, or a dict of another library
    name: Any  # the attribute's name, or the dict's key
    original: Any  # what the target held (MISSING: nothing)
    replacement: Any


# (id(target), name) -> Patch, in install order (dicts keep it). The target
# itself is kept alive by its Patch, so its id cannot be reused meanwhile.
_patches: dict[tuple[int, Any], Patch] = {}


def lock() -> threading.RLock:
    """The registry's lock, for an install made of several replacements."""
    return _lock


def _held(target: Any, name: Any) -> Any:
    if isinstance(target, dict):
        return target.get(name, MISSING)
    return vars(target).get(name, MISSING)


def _put(target: Any, name: Any, value: Any) -> None:
    if isinstance(target, dict):
        if value is MISSING:
            target.pop(name, None)
        else:
            target[name] = value
    elif value is MISSING:
        delattr(target, name)
    else:
        setattr(target, name, value)


def _resolved(target: Any, name: Any) -> Any:
    if isinstance(target, dict):
        return target.get(name)
    if isinstance(target, type):  # the descriptor itself (a property, a function)
        for cls in target.__mro__:
            if name in vars(cls):
                return vars(cls)[name]
        return None
    return getattr(target, name, None)


def replace(owner: str, target: Any, name: Any, make: Callable[[Any], Any]) -> Any:
    """Sets ``target.name`` (``target[name]`` for a dict) to ``make(current)``,
    ``current`` being what the target resolves the name to now (None where
    nothing), and records the original; once: a name already replaced keeps
    its replacement, which is returned."""
    with _lock:
        key = (id(target), name)
        if key in _patches:
            return _patches[key].replacement
        new = make(_resolved(target, name))
        _patches[key] = Patch(owner, target, name, _held(target, name), new)
        _put(target, name, new)
        return new


def replaced(target: Any, name: Any) -> bool:
    """Whether ``target.name`` is one of cplib's replacements now."""
    return (id(target), name) in _patches


def original(target: Any, name: Any) -> Any:
    """What ``target`` held under ``name`` before cplib (MISSING: nothing);
    what it holds now where cplib replaced nothing there."""
    patch = _patches.get((id(target), name))
    return _held(target, name) if patch is None else patch.original


def patches(owner: str | None = None) -> list[Patch]:
    """Every replacement installed now (``owner``'s only, when given), oldest first."""
    with _lock:
        return [p for p in _patches.values() if owner is None or p.owner == owner]


def restore(owner: str | None = None) -> int:
    """Puts back every original that ``owner`` (every owner: None) replaced,
    newest first; returns how many. Idempotent."""
    with _lock:
        undo = [k for k, p in _patches.items() if owner is None or p.owner == owner]
        for key in reversed(undo):
            patch = _patches.pop(key)
            _put(patch.target, patch.name, patch.original)
        return len(undo)
