"""Everything cplib knows about Hugging Face transformers, in one package.

What it installs, all through cplib's patch registry (owner ``"transformers"``,
cplib/patch_registry.py), so that :func:`uninstall` (and
``cplib.unpatch_torch()``) puts every original back:

* the causal-LM, masked-LM and token-classification losses over the whole
  sequence, HF's other losses refused, and MoE routers' load-balancing loss
  over every token (losses.py, router_loss.py);
* hybrid models' recurrent and conv layers carried across the ranks or
  refused (hybrid.py, hybrid_families.py);
* the refusal of attention paths that stay within a shard (attention_guard.py);
* the sparse-attention (DeepSeek Sparse Attention) layers' indexer over the
  whole sequence and their attention over the selected keys (sparse/);
* every model's forward guarded (forward_guard.py): the module-path scope of
  sharded inputs, and the refusal of families classified as not exact
  (families.py), of pooled heads (pooled.py) and of losses a model computes
  itself (own_loss.py);
* ``attn_implementation="cplib"`` refused, when it is set, for the families
  that cannot run it (families.py).

Installed by ``import cplib.hf``, by ``cplib.patch_torch()`` and whenever
cplib's context parallelism starts while transformers is imported
(``cplib.context_parallel``, ``_context_parallel_shard``,
``_ContextParallel``): docs/integrations.md has the table. Installing is
idempotent and local (no collective). Outside context parallelism every
replacement calls straight through: a model computes what transformers
computes.
"""

from __future__ import annotations

import sys
from typing import Any

from ... import patch_registry as registry
from .attention_guard import install_attention_guard
from .families import guarded_attn_implementation
from .forward_guard import guarded_forward
from .hybrid import patch_hybrid_module
from .losses import install_losses, wrap_router_loss
from .models import OWNER, guard_forward, model_classes, model_modules
from .sparse import patch_sparse_module

__all__ = ["install", "uninstall", "installed", "OWNER"]


def installed() -> bool:
    return bool(registry.patches(OWNER))


def _reach_module(name: str, module: Any) -> None:
    """What the integration replaces in one model module: its hybrid layers'
    kernels and mixers, its router loss, its model classes' forward."""
    patch_hybrid_module(name, module)
    patch_sparse_module(name, module)
    wrap_router_loss(module)
    for cls in model_classes(module):
        guard_forward(cls, guarded_forward)


def _reach_model(model: Any) -> None:
    """A model being built (``PreTrainedModel.post_init``): its class and
    the modules of its classes, whichever module defines them."""
    for cls in type(model).__mro__:
        module = sys.modules.get(cls.__module__)
        if module is not None and cls.__module__.startswith("transformers.models."):
            _reach_module(cls.__module__, module)
    guard_forward(type(model), guarded_forward)  # a subclass of the user's own too


def _post_init(post_init: Any) -> Any:
    def post_init_reaching_the_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = post_init(self, *args, **kwargs)
        _reach_model(self)
        return result

    post_init_reaching_the_model.__wrapped__ = post_init  # type: ignore[attr-defined]
    return post_init_reaching_the_model


# The model modules reached so far (each once; forgotten on uninstall).
_reached: set[str] = set()


def install(import_transformers: bool = False) -> None:
    """Installs the integration (once) and reaches the model modules imported
    since the last call (a layer class built without a model, a model
    module imported after a model of another family was built). Without
    ``import_transformers``, only where transformers' models are imported
    already: before that no model of it exists."""
    if not import_transformers and "transformers.modeling_utils" not in sys.modules:
        return
    from transformers.modeling_utils import PreTrainedModel

    with registry.lock():
        if not installed():
            install_losses()
            install_attention_guard()
            registry.replace(OWNER, PreTrainedModel, "get_correct_attn_implementation",
                             guarded_attn_implementation)
            registry.replace(OWNER, PreTrainedModel, "post_init", _post_init)
        for name, module in model_modules():
            if name not in _reached:
                _reach_module(name, module)
                _reached.add(name)


def uninstall() -> None:
    """Puts back everything :func:`install` replaced in transformers."""
    with registry.lock():
        registry.restore(OWNER)
        _reached.clear()
