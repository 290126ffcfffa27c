"""diffusers models under ``context_parallel(mesh, modules=[model])``.

A diffusers model says in ``model._cp_plan`` where its forward splits inputs
along the sequence and gathers outputs (diffusers' own convention; QwenImage
splits inside forward, after building its rotary table from the full image
shape). cplib applies that plan with diffusers' hook machinery
(``diffusers.hooks.context_parallel``) for the duration of the context, with
sequential any-length shards (``tensor_split``, the layout of cplib's
sequential sharding), while cplib's attention runs every SDPA call inside.
On exit the hooks are removed and every attribute they left on the modules
(a bound ``forward``, the hook registry) is put back as it was.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["applied_cp_plans", "plan_of"]

_MISSING = object()
_TOUCHED = ("forward", "_diffusers_hook")  # what diffusers' hook registry sets on a module


@dataclass
class _HookConfig:
    """The part of diffusers' ``ContextParallelConfig`` its split and gather
    hooks read: the mesh, and any-length (``tensor_split``) shards."""

    _mesh: DeviceMesh
    ulysses_anything: bool = True
    ring_anything: bool = False

    @property
    def _flattened_mesh(self) -> DeviceMesh:
        return self._mesh


def plan_of(module: torch.nn.Module, i: int) -> dict:
    if not isinstance(module, torch.nn.Module):
        raise ValueError(f"cplib.context_parallel: modules[{i}] is a {type(module).__name__}, "
                         "not a torch.nn.Module")
    plan = getattr(module, "_cp_plan", None)
    if not isinstance(plan, dict) or not plan:
        raise ValueError(f"cplib.context_parallel: modules[{i}] ({type(module).__name__}) has no "
                         "_cp_plan (diffusers' description of where its forward splits and "
                         "gathers the sequence); shard its inputs with buffers= instead")
    return plan


@contextlib.contextmanager
def applied_cp_plans(mesh: DeviceMesh, modules: Sequence[torch.nn.Module]
                     ) -> Generator[None, None, None]:
    """Applies every module's ``_cp_plan`` over ``mesh`` while the block runs."""
    plans = [plan_of(m, i) for i, m in enumerate(modules)]
    if not plans:
        yield
        return
    try:
        from diffusers.hooks.context_parallel import (
            apply_context_parallel,
            remove_context_parallel,
        )
    except ImportError as e:
        raise ValueError("cplib.context_parallel: modules= applies diffusers' _cp_plan with "
                         "diffusers' hooks; install diffusers") from e
    config = _HookConfig(mesh)
    saved = [(sub, {name: sub.__dict__.get(name, _MISSING) for name in _TOUCHED})
             for m in modules for sub in m.modules()]
    applied = []
    try:
        for m, plan in zip(modules, plans):
            apply_context_parallel(m, config, plan)
            applied.append((m, plan))
        yield
    finally:
        for m, plan in reversed(applied):
            remove_context_parallel(m, plan)
        for sub, attrs in saved:
            for name, value in attrs.items():
                if value is _MISSING:
                    sub.__dict__.pop(name, None)
                else:
                    sub.__dict__[name] = value
