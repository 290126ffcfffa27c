"""``cplib.patch_torch()``: torch's context-parallel names, where the clients
look them up, run cplib's.

accelerate (``Accelerator.prepare()``), HF Trainer (through accelerate) and
torchtitan (at import) take ``context_parallel``, ``set_rotate_method``, the
load balancers, the dispatcher switches and ``flex_cp_allgather`` from torch's
modules by name. The switch sets those module attributes to cplib's objects
(through the registry, owner ``"torch"``), so every later ``from
torch.distributed.tensor.experimental... import X`` gets cplib's ``X``; a
module that imported ``X`` before the switch keeps torch's (hence: call it
before ``Accelerator.prepare()`` and before importing torchtitan).
``unpatch_torch()`` puts back exactly what was there, and what cplib
installed into transformers.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
import warnings

from .. import patch_registry as registry

__all__ = ["patch_torch", "unpatch_torch", "torch_is_patched", "PATCHED_MODULES", "OWNER"]

OWNER = "torch"
_EXPERIMENTAL = "torch.distributed.tensor.experimental"
_LOAD_BALANCERS = ("_HeadTailLoadBalancer", "_LoadBalancer", "_PerDocumentHeadTailLoadBalancer",
                   "_PTRRLoadBalancer")
# torch's context-parallel API (same names and signatures in cplib).
_API = ("_CausalBehavior", "_context_parallel_shard", "_ContextParallel", "_cp_options",
        "_disable_context_parallel_dispatcher", "_enable_context_parallel_dispatcher",
        "_is_causal_behavior", "_RotateMethod", "context_parallel", "context_parallel_unshard",
        "set_rotate_method") + _LOAD_BALANCERS

# Each module of torch's that holds context-parallel names, and the names the
# switch sets there (those torch 2.13 defines there, and every name the
# pinned clients import from it: tests/integrations/test_patch_torch.py reads their
# source). A module this torch lacks is skipped.
PATCHED_MODULES: dict[str, tuple[str, ...]] = {
    _EXPERIMENTAL: ("context_parallel",),
    f"{_EXPERIMENTAL}._attention": _API,
    f"{_EXPERIMENTAL}._context_parallel": _API + ("flex_cp_allgather",),
    f"{_EXPERIMENTAL}._context_parallel._attention":
        _API + ("flex_cp_allgather", "_create_cp_block_mask"),
    f"{_EXPERIMENTAL}._context_parallel._load_balancer": _LOAD_BALANCERS,
    f"{_EXPERIMENTAL}._context_parallel._cp_custom_ops": ("flex_cp_allgather",),
    # Where torch releases before the _context_parallel package kept them.
    f"{_EXPERIMENTAL}._load_balancer": _LOAD_BALANCERS,
    f"{_EXPERIMENTAL}._cp_custom_ops": ("flex_cp_allgather",),
}


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
    API where accelerate, Trainer and torchtitan import it) cplib's, and
    installs cplib's interception of transformers where it is installed (its
    losses, hybrid layers and attention guards: docs/integrations.md).
    Idempotent; undone by :func:`unpatch_torch`."""
    import cplib

    with registry.lock():
        if torch_is_patched():
            return
        for module, attrs in _modules():
            for attr in attrs:
                registry.replace(OWNER, module, attr, lambda _, a=attr: getattr(cplib, a))
    late = _holders_of_torch_names()
    if late:
        warnings.warn(f"cplib.patch_torch(): {', '.join(late[:6])} took torch's context-parallel "
                      "names before the switch and keep them; call cplib.patch_torch() before "
                      "importing them", stacklevel=2)
    if importlib.util.find_spec("transformers") is not None:
        from .transformers import install

        install(import_transformers=True)


def _holders_of_torch_names() -> list[str]:
    """``module.name`` of every module outside torch and cplib whose globals
    hold one of the torch objects the switch replaced (imported before it)."""
    replaced = {id(p.original) for p in registry.patches(OWNER)
                if p.original is not registry.MISSING}
    found = []
    for name, module in list(sys.modules.items()):
        if module is None or name.split(".")[0] in ("torch", "cplib"):
            continue
        found += [f"{name}.{attr}" for attr, value in list(getattr(module, "__dict__", {}).items())
                  if id(value) in replaced]
    return found


def unpatch_torch() -> None:
    """Puts back what :func:`patch_torch` replaced in torch, and everything
    cplib installed into transformers unless ``import cplib.hf`` keeps it
    (its ``"cplib"`` models need it): a no-op where nothing is installed. The
    next context-parallel start installs into transformers again."""
    from .transformers import uninstall

    with registry.lock():
        registry.restore(OWNER)
        if not registry.patches("cplib.hf"):
            uninstall()


def torch_is_patched() -> bool:
    return bool(registry.patches(OWNER))
