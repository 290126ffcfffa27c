"""A sparse attention layer's forward under context parallelism: the
model's own forward runs, with cplib at three of its points.

Outside context parallelism the wrappers call straight through. Under it
(a region, or the module-path scope of sharded inputs), the layer's forward
opens a call (call.py) and runs the original forward with

* ``attention_mask``: a broadcast (B, 1, L, S) True (no memory), so that the
  layer's own mask arithmetic (the indexer's selection scattered over the
  keys, for eager and SDPA) has the width of the whole sequence; the
  visibility that counts (causal in global positions, padding, documents)
  is cplib's, taken from the layout, the mask given and the context;
* ``past_key_values``: None (a cache would hold one rank's shard; a cache
  that already holds this layer is a continuation, refused);
* ``expand_kv(k_pass, k_rot)``: the latents are kept in the call and a
  broadcast (no memory) of the whole sequence's K/V shape is returned; the
  attention function expands only the rows it reads.

The indexer (indexer.py) and the attention function (attend.py) do the rest.
Refusals (documents per batch row, Ulysses, dropout) are raised on every
rank alike, before any collective: they read the config and the layout.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch

from ....frontend.sdpa_dispatch import active_config
from ....frontend.sequence import sequence_shards
from ....sparse import all_rows
from .attend import sparse_attention
from .call import SparseCall, close_call, current, open_call, row_layout

__all__ = ["layer_forward", "expand_kv"]


def _refuse(what: str, reason: str) -> NotImplementedError:
    return NotImplementedError(
        f"cplib: {what}: sparse attention under context parallelism {reason}")


def _engaged(layer: Any) -> bool:
    """Whether the layer selects keys (its own indexer, or the previous
    layer's selection); a dense layer of the same class runs as it is."""
    return getattr(layer, "indexer", None) is not None or bool(getattr(layer, "skip_topk", False))


def _local_key_valid(mask: Any, rows: int) -> torch.Tensor | None:
    """This rank's keys' validity (B, L) from the mask the layer was given:
    a 2-D padding mask ("cplib"), or the diagonal of transformers' 4-D mask
    of this shard (SDPA: a token sees itself unless it is padding)."""
    if mask is None:
        return None
    if mask.dim() == 2:
        return mask.bool()
    if mask.dim() == 4 and mask.shape[-1] == mask.shape[-2] == rows:
        diag = torch.diagonal(mask[:, 0], dim1=-2, dim2=-1)
        return diag if diag.dtype == torch.bool else diag == 0
    raise NotImplementedError(
        f"cplib: a sparse attention layer under context parallelism got an attention mask "
        f"of shape {tuple(mask.shape)}; it takes none, a 2-D padding mask, or transformers' "
        "mask of this shard")


def _global_key_valid(local: torch.Tensor | None, rows, batch: int) -> torch.Tensor | None:
    if local is None:
        return None
    local = local.expand(batch, -1).to(torch.uint8)[..., None]
    return all_rows(local, rows)[..., 0].bool()


def _check(layer: Any, what: str, bound: inspect.BoundArguments) -> None:
    config = active_config()
    if config is not None and config.ulysses_degree > 1:
        raise _refuse(what, "runs over the whole CP group: use ulysses_degree=1")
    if layer.training and getattr(layer, "attention_dropout", 0.0):
        raise _refuse(what, "has no attention dropout: set the model's attention_dropout to 0")
    cache = bound.arguments.get("past_key_values")
    if cache is not None and int(cache.get_seq_length(layer.layer_idx)) > 0:
        raise _refuse(what, "starts from an empty cache (this one holds the layer's keys: a "
                      "continuation); pass use_cache=False or start a new cache")


def _run(original: Callable, layer: Any, bound: inspect.BoundArguments, what: str,
         shards) -> Any:
    hidden = bound.arguments["hidden_states"]
    batch, rows_here = hidden.shape[:2]
    rows, q_pos = row_layout(shards, hidden.device)
    config = active_config()
    mask = bound.arguments.get("attention_mask")
    key_valid = _global_key_valid(_local_key_valid(mask, rows_here), rows, batch)
    call = SparseCall(layer, what, rows, q_pos, key_valid,
                      None if config is None else config.cu_seqlens, sparse_attention)
    if bound.arguments.get("prev_topk_indices") is not None:
        call.topk = bound.arguments["prev_topk_indices"]
    bound.arguments["attention_mask"] = torch.ones((), dtype=torch.bool, device=hidden.device) \
        .expand(batch, 1, rows_here, rows.seq_len)
    if "past_key_values" in bound.arguments:
        bound.arguments["past_key_values"] = None
    token = open_call(call)
    try:
        return original(*bound.args, **bound.kwargs)
    finally:
        close_call(token)


def layer_forward(original: Callable, family: str) -> Callable:
    """The attention layer's ``forward``, run as the module docstring says
    under context parallelism."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not _engaged(self):
            return original(self, *args, **kwargs)
        if torch.compiler.is_compiling():
            if active_config() is not None:
                raise _refuse(f"{type(self).__name__} ({family})",
                              "runs eagerly under context parallelism: compile the model "
                              "outside the region, or not at all")
            return original(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        hidden = bound.arguments["hidden_states"]
        shards = sequence_shards(hidden.shape[1])
        if shards is None:
            if active_config() is not None:
                raise _refuse(f"{type(self).__name__} ({family})",
                              "reads the layout of a cplib.context_parallel region or of "
                              "sharded inputs, and found neither")
            return original(self, *args, **kwargs)
        what = f"{type(self).__name__} ({family})"
        _check(self, what, bound)
        return _run(original, self, bound, what, shards)

    forward.__cplib_original__ = original  # type: ignore[attr-defined]
    return forward


def expand_kv(original: Callable) -> Callable:
    """The layer's ``expand_kv``: in a call of this layer, keeps the latents
    and returns broadcasts of the whole sequence's K/V shape."""

    @functools.wraps(original)
    def expand(self, kv_nope: torch.Tensor, k_rot: torch.Tensor):
        call = current()
        if call is None or call.module is not self:
            return original(self, kv_nope, k_rot)
        call.latents = (kv_nope, k_rot)
        call.expand = functools.partial(original, self)
        k, v = original(self, kv_nope[:, :, :1], k_rot[:, :, :1])  # the shapes alone
        width = call.rows.seq_len
        return (k.new_zeros(()).expand(*k.shape[:2], width, k.shape[-1]),
                v.new_zeros(()).expand(*v.shape[:2], width, v.shape[-1]))

    expand.__cplib_original__ = original  # type: ignore[attr-defined]
    return expand
