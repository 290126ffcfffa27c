"""``attn_implementation="cplib"`` for the sparse families outside context
parallelism: what their eager and SDPA paths compute.

Their layers read transformers' 4-D mask (the indexer masks its scores with
it) and, for an implementation other than eager or SDPA, pass the
selection as ``indices=`` next to that mask. So in one process
``cplib_mask`` hands them eager's mask (:func:`wants_full_mask`), and the
attention folds ``indices`` into it as the layer itself does for eager
(:func:`with_selection`). Under context parallelism neither is used: the
layer's own call takes over (layer.py).
"""

from __future__ import annotations

from typing import Any

import torch

from ....frontend.sdpa_dispatch import active_config
from ....frontend.sequence import layout_in_scope
from .families import SPARSE_FAMILIES

__all__ = ["wants_full_mask", "with_selection"]


def wants_full_mask(config: Any) -> str | None:
    """The sparse family whose model ``config`` is, outside context
    parallelism (None: another family, or context parallelism in effect)."""
    module = type(config).__module__.split(".") if config is not None else []
    family = module[2] if len(module) > 2 and module[:2] == ["transformers", "models"] else None
    if family not in SPARSE_FAMILIES or active_config() is not None or \
            layout_in_scope() is not None:
        return None
    return family


def with_selection(mask: torch.Tensor, indices: torch.Tensor, keys: int) -> torch.Tensor:
    """``mask`` (eager's 4-D, additive or boolean) with every key outside
    ``indices`` (B, L, K) masked, as the layers do for eager and SDPA."""
    dropped = torch.ones((*indices.shape[:2], keys), dtype=torch.bool, device=indices.device)
    dropped = dropped.scatter(-1, indices.long(), False).unsqueeze(1)
    if mask.dtype == torch.bool:
        return mask & ~dropped
    return mask.masked_fill(dropped, torch.finfo(mask.dtype).min)
