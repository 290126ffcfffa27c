"""Hybrid models under context parallelism: the sequence-mixing layers of
transformers' models that are not attention (hybrid_families.py) either run
exactly or raise, on every rank, naming the layer.

How it reaches the model: transformers' layers call their kernels by a
module-level name (``causal_conv1d_fn``, ``torch_chunk_gated_delta_rule``,
``mamba2_chunk_scan``, ...), bound through its kernel registry to fla,
causal_conv1d or mamba_ssm where installed and to torch code otherwise.
:func:`patch_family` replaces those names in each family's module with a
wrapper, and the mixer classes' ``forward`` with one (through cplib's patch
registry), in every family module imported when the integration installs
and in every model built afterwards (__init__.py).

Outside context parallelism both wrappers call straight through: a model
outside CP computes exactly what it did. Under it (a ``cplib.context_parallel``
region, a model's forward given shards of ``_context_parallel_shard``, or a
layer given such a shard itself: hybrid_layout.py) the layer's wrapper finds
the layout, and the kernel wrappers put the exchange around the user's kernel
(cplib/hybrid/): the conv by halo, the delta rule by head re-sharding or state
passing, Mamba2's scan by state passing. Layers that cplib cannot carry raise
NotImplementedError before their first collective.

A cache (``use_cache=True``, transformers' default) is not filled by these
layers under CP: its states would be one rank's; a cache that already holds
a state for the layer (a continuation) raises.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from typing import Any, Callable

from ... import patch_registry as registry
from ...frontend.sequence import active_handle as _active_handle
from ...hybrid.layout import SequenceLayout
from .hybrid_families import FAMILIES, KERNEL_ROLES, SELECTORS, Mixer
from .hybrid_kernels import HANDLERS
from .hybrid_layout import layout_in_effect
from .models import OWNER

__all__ = ["patch_family", "patch_hybrid_module"]

# The layout and name of the mixer layer running now under CP (its kernel
# calls read it); per thread, like the dispatch mode that marks the context.
_scope: contextvars.ContextVar[tuple[SequenceLayout, str] | None] = \
    contextvars.ContextVar("cplib_hybrid_layer", default=None)


def _family(module_name: str) -> str | None:
    parts = module_name.split(".")
    if len(parts) >= 3 and parts[:2] == ["transformers", "models"] and parts[2] in FAMILIES:
        return parts[2]
    return None


def _kernel_wrapper(original: Callable, role: str, name: str) -> Callable:
    handler = HANDLERS[role]

    @functools.wraps(original)
    def kernel(*args: Any, **kwargs: Any) -> Any:
        scope = _scope.get()
        if scope is not None:  # inside a layer that runs under context parallelism
            return handler(original, name, scope[0], scope[1], args, kwargs)
        if _active_handle() is None:
            return original(*args, **kwargs)
        raise NotImplementedError(
            f"cplib: {name} was called under cplib.context_parallel outside a layer cplib "
            "knows (cplib/integrations/transformers/hybrid_families.py): it would run on this "
            "rank's shard alone; call the model's own layers, or run outside the context")

    kernel.__cplib_original__ = original  # type: ignore[attr-defined]
    return kernel


def _refuse(what: str, reason: str) -> NotImplementedError:
    return NotImplementedError(
        f"cplib: {what} under context parallelism: {reason}. Run on this rank's shard "
        "alone, it would not see the sequence before the shard (a wrong result), so it "
        "raises on every rank; run this model without context parallelism")


def _check_cache(cache: Any, layer: Any, what: str) -> None:
    """A cache that already holds this layer's state (a continuation) cannot be
    carried across ranks; an empty one (a prefill) is left unfilled."""
    index, state = getattr(layer, "layer_idx", None), getattr(layer, "conv_idx", 0)
    layers = getattr(cache, "layers", None)
    if not (isinstance(layers, list) and isinstance(index, int) and 0 <= index < len(layers)):
        return
    flags = getattr(layers[index], "has_previous_state", None)  # per state index
    held = flags.get(state) if isinstance(flags, dict) else \
        flags[state] if isinstance(flags, (list, tuple)) and state < len(flags) else False
    if held:
        raise NotImplementedError(
            f"cplib: {what} under cplib.context_parallel with a cache that already holds its "
            "state (a continuation): not supported; start from an empty cache or pass "
            "use_cache=False")


def _layer_wrapper(original: Callable, mixer: Mixer, family: str) -> Callable:
    signature = inspect.signature(original)
    cache_arg = next((p for p in ("cache_params", "past_key_values")
                      if p in signature.parameters), None)
    first = list(signature.parameters)[1]  # the hidden states, after self

    @functools.wraps(original)
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        what = f"{type(self).__name__} ({family})"
        if _active_handle() is not None and mixer.refusal is not None:
            raise _refuse(what, mixer.refusal)
        layout = layout_in_effect(args[0] if args else kwargs[first], what)
        if layout is None:  # no context parallelism in scope
            return original(self, *args, **kwargs)
        if mixer.refusal is not None:
            raise _refuse(what, mixer.refusal)
        bound = signature.bind(self, *args, **kwargs)
        if cache_arg is not None and bound.arguments.get(cache_arg) is not None:
            _check_cache(bound.arguments[cache_arg], self, what)
            bound.arguments[cache_arg] = None
        token = _scope.set((layout, what))
        try:
            return original(*bound.args, **bound.kwargs)
        finally:
            _scope.reset(token)

    forward.__cplib_original__ = original  # type: ignore[attr-defined]
    return forward


def patch_family(module: Any, family: str) -> None:
    """Wraps ``module``'s kernel names and mixer classes (once each)."""
    for name, role in KERNEL_ROLES.items():
        if callable(getattr(module, name, None)):
            registry.replace(OWNER, module, name,
                             lambda fn, role=role, name=name: _kernel_wrapper(fn, role, name))
    for mixer in FAMILIES[family] + SELECTORS.get(family, ()):
        cls = getattr(module, mixer.name, None)
        if isinstance(cls, type):
            registry.replace(OWNER, cls, "forward",
                             lambda fn, mixer=mixer: _layer_wrapper(fn, mixer, family))


def patch_hybrid_module(module_name: str, module: Any) -> None:
    """:func:`patch_family` for ``module`` when it is a hybrid family's
    modeling module (``transformers.models.<family>.modeling_*``)."""
    family = _family(module_name)
    if family is not None and module_name.rpartition(".")[2].startswith("modeling_"):
        patch_family(module, family)
