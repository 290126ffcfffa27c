"""``cplib.patch_torch()``: torch's context-parallel names, where the clients
look them up, run cplib's.

accelerate (``Accelerator.prepare()``), HF Trainer (through accelerate) and
torchtitan (at import) take ``context_parallel``, ``set_rotate_method``, the
load balancers, the dispatcher switches and ``flex_cp_allgather`` from torch's
modules by name. The switch sets those module attributes to cplib's objects,
so every later ``from torch.distributed.tensor.experimental... import X`` gets
cplib's ``X``; a module that imported ``X`` before the switch keeps torch's
(hence: call it before ``Accelerator.prepare()`` and before importing
torchtitan). ``unpatch_torch()`` puts back exactly what was there.
"""

from __future__ import annotations

import importlib
import types

__all__ = ["patch_torch", "unpatch_torch", "torch_is_patched", "PATCHED_MODULES"]

_EXPERIMENTAL = "torch.distributed.tensor.experimental"
_LOAD_BALANCERS = ("_HeadTailLoadBalancer", "_LoadBalancer", "_PerDocumentHeadTailLoadBalancer",
                   "_PTRRLoadBalancer")
# torch's context-parallel API (same names and signatures in cplib).
_API = ("_CausalBehavior", "_context_parallel_shard", "_ContextParallel", "_cp_options",
        "_disable_context_parallel_dispatcher", "_enable_context_parallel_dispatcher",
        "_is_causal_behavior", "_RotateMethod", "context_parallel", "context_parallel_unshard",
        "set_rotate_method") + _LOAD_BALANCERS

# Each module of torch's that holds context-parallel names, and the names the
# switch sets there (those torch 2.11 to 2.15 define there, and every name the
# pinned clients import from it: tests/clients/test_patch_torch.py reads their
# source). A module this torch lacks is skipped.
PATCHED_MODULES: dict[str, tuple[str, ...]] = {
    _EXPERIMENTAL: ("context_parallel",),
    f"{_EXPERIMENTAL}._attention": _API,
    f"{_EXPERIMENTAL}._context_parallel": _API + ("flex_cp_allgather",),
    f"{_EXPERIMENTAL}._context_parallel._attention":
        _API + ("flex_cp_allgather", "_create_cp_block_mask"),
    f"{_EXPERIMENTAL}._context_parallel._load_balancer": _LOAD_BALANCERS,
    f"{_EXPERIMENTAL}._context_parallel._cp_custom_ops": ("flex_cp_allgather",),
}

_MISSING = object()
# (module, name) -> what was there before the switch (_MISSING: nothing);
# empty while torch is not patched.
_saved: dict[tuple[types.ModuleType, str], object] = {}


def _modules() -> list[tuple[types.ModuleType, tuple[str, ...]]]:
    found = []
    for name, attrs in PATCHED_MODULES.items():
        try:
            found.append((importlib.import_module(name), attrs))
        except ImportError:  # a torch without this module
            continue
    return found


def patch_torch() -> None:
    """Makes every name in :data:`PATCHED_MODULES` (torch's context-parallel
    API where accelerate, Trainer and torchtitan import it) cplib's
    (docs/clients.md). Idempotent; undone by :func:`unpatch_torch`."""
    import cplib

    if _saved:
        return
    for module, attrs in _modules():
        for attr in attrs:
            _saved[(module, attr)] = module.__dict__.get(attr, _MISSING)
            setattr(module, attr, getattr(cplib, attr))


def unpatch_torch() -> None:
    """Puts back what :func:`patch_torch` replaced (a no-op when torch is not
    patched)."""
    if not _saved:
        return
    for (module, attr), old in _saved.items():
        if old is _MISSING:
            delattr(module, attr)
        else:
            setattr(module, attr, old)
    _saved.clear()


def torch_is_patched() -> bool:
    return bool(_saved)
