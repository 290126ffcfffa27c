"""The attention of a sparse layer under context parallelism: this rank's
queries over the keys its indexer selected, from the whole sequence.

The keys attended (the union of this rank's selections that it may see:
cplib.sparse.attended) are read as MLA latents, ``k_pass | k_rot`` (576
values a token for DeepSeek-V3.2, whatever the number of heads), from their
owners: the whole sequence gathered, or only the rows selected fetched,
whichever moves fewer bytes over the ranks (cplib.sparse.plan_rows, logged
at debug level on the ``cplib`` logger); then the layer's own ``expand_kv``
expands just those rows to every head, and cplib.sparse.masked_attention
attends with the selection as the mask. The gradients of the latents read
go back to their owners (the reduce-scatter of the gather, the scatter-add
of the fetch), and on through the model's own projections.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ....sparse import attended, masked_attention, plan_rows, take_rows
from .call import current

__all__ = ["sparse_attention", "set_exchange"]

_log = logging.getLogger("cplib")
_exchange = ["auto"]


def set_exchange(strategy: str) -> None:
    """How sparse layers read the latents of other ranks: "auto" (fewer
    bytes), "gather" or "fetch" (process-wide; tests and benchmarks)."""
    if strategy not in ("auto", "gather", "fetch"):
        raise ValueError(f"cplib: exchange must be 'auto', 'gather' or 'fetch', got {strategy!r}")
    _exchange[0] = strategy


def sparse_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: Any, dropout: float = 0.0,
                     scaling: float | None = None, sliding_window: int | None = None,
                     s_aux: torch.Tensor | None = None, softcap: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """A transformers attention function (the layer's lookup returns it in
    a sparse call): ``key``, ``value`` and ``attention_mask`` are the
    layer's broadcasts (layer.py) and are not read."""
    call = current()
    if call is None or call.latents is None or call.topk is None:
        raise RuntimeError("cplib: the sparse attention ran outside its layer's call")
    if dropout or softcap is not None or sliding_window is not None:
        raise NotImplementedError(
            f"cplib: {call.what}: sparse attention under context parallelism takes no "
            f"dropout, soft-capping or sliding window (got {dropout}, {softcap}, "
            f"{sliding_window})")
    keys, mask = attended(call.topk, call.q_pos, call.key_valid, call.cu_seqlens)
    k_pass, k_rot = call.latents
    latent = torch.cat([k_pass, k_rot], -1)[:, 0]  # (B, L, R + r): one row a token
    row_bytes = latent.shape[0] * latent.shape[-1] * latent.element_size()
    plan = plan_rows(keys, call.rows, row_bytes, _exchange[0])
    call.plan = plan
    _log.debug("cplib: %s reads %d keys by %s: %d bytes received (the other way: %d)",
               call.what, keys.numel(), plan.strategy, plan.received, plan.other)
    rows = take_rows(latent, keys, call.rows, plan)
    k_rows, r_rows = rows.split([k_pass.shape[-1], k_rot.shape[-1]], -1)
    k, v = call.expand(k_rows[:, None], r_rows[:, None])
    out = masked_attention(query, k, v, mask, scaling, s_aux)
    return out.transpose(1, 2).contiguous(), None
