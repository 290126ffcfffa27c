"""DeepSeek Sparse Attention models of transformers under context
parallelism (issue 55): the families listed in families.py run their own
forward, with the indexer scoring over the whole sequence (indexer.py) and
the attention reading the selected keys' latents from their owners
(attend.py), wired in at the layer (layer.py); one_process.py gives
``attn_implementation="cplib"`` their selection outside context parallelism.
The generic math is cplib.sparse; docs/sparse.md."""

from __future__ import annotations

from typing import Any

from .... import patch_registry as registry
from ..models import OWNER
from .attend import set_exchange
from .call import attention_taken_over
from .families import SPARSE_FAMILIES
from .indexer import indexer_forward
from .layer import expand_kv, layer_forward

__all__ = ["patch_sparse_module", "attention_taken_over", "set_exchange", "SPARSE_FAMILIES"]


def patch_sparse_module(module_name: str, module: Any) -> None:
    """Wraps the attention layer's ``forward`` and ``expand_kv`` and the
    indexer's ``forward`` in ``module`` when it is a listed family's
    modeling module (once each, through the patch registry)."""
    parts = module_name.split(".")
    if len(parts) < 4 or parts[:2] != ["transformers", "models"] or \
            not parts[3].startswith("modeling_"):
        return
    family = SPARSE_FAMILIES.get(parts[2])
    if family is None:
        return
    layer, indexer = getattr(module, family.attention, None), getattr(module, family.indexer, None)
    if not isinstance(layer, type) or not isinstance(indexer, type):
        return
    registry.replace(OWNER, layer, "forward", lambda fn: layer_forward(fn, parts[2]))
    registry.replace(OWNER, layer, "expand_kv", expand_kv)
    registry.replace(OWNER, indexer, "forward",
                     lambda fn: indexer_forward(fn, family.per_query))
