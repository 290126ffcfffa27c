"""A lightning indexer under context parallelism: this rank's queries
scored against the keys of the whole sequence, with the model's own code.

The indexer's forward computes its one-head keys, hands them to
``past_key_values.update_indexer(k, layer_idx)`` (a cache's keys come back
from it), scores its queries against what comes back, masks and takes the
top-k. cplib calls that forward twice over:

1. with a cache that stops it at ``update_indexer``: this rank's keys
   (B, L, D), the indexer's own projection, norm and RoPE;
2. gathered over the ranks into the whole sequence in global order (one
   all-gather: D values a token, independent of the attention's heads),
   then, for each block of this rank's queries, the forward again on the
   block's rows, with a cache whose ``update_indexer`` returns the whole
   sequence's keys and with cplib's mask of what the block may see (causal
   in global positions, padding, documents: cplib.sparse.visible).

A block holds ``cplib.sparse.query_block(L, max(heads, head_dim))``
queries, so its per-head scores (block x heads x S), and the keys its
matmul broadcasts to every query (block x head_dim x S: transformers'
broadcasting matmul copies them), never exceed L x S floats: this rank's
queries against the sequence. (One process holds S x max(heads, head_dim)
x S.) Each query's row of scores is what one process
computes for it (the same keys in the same order, the same arithmetic), so
its top-k is one process's, up to rounding between scores that are equal.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch

from ....frontend.sdpa_dispatch import active_config
from ....frontend.sequence import layout_in_scope
from ....sparse import all_rows, query_block, visible
from .call import SparseCall, current

__all__ = ["indexer_forward"]


class _Keys(Exception):
    """Raised by :class:`_StopAtKeys` with the indexer's keys."""

    def __init__(self, keys: torch.Tensor) -> None:
        super().__init__("cplib: the indexer's keys")
        self.keys = keys


class _StopAtKeys:
    def update_indexer(self, keys: torch.Tensor, layer_idx: int) -> torch.Tensor:
        raise _Keys(keys)


class _AllKeys:
    def __init__(self, keys: torch.Tensor) -> None:
        self.keys = keys

    def update_indexer(self, keys: torch.Tensor, layer_idx: int) -> torch.Tensor:
        return self.keys


def _rows(value: Any, a: int, b: int) -> Any:
    """Rows a:b of one per-query argument (sequence on dim 1; a tuple of such)."""
    if isinstance(value, tuple):
        return tuple(_rows(v, a, b) for v in value)
    if isinstance(value, torch.Tensor):
        return value.narrow(min(1, value.dim() - 1), a, b - a)
    return value


def _own_keys(original: Callable, bound: inspect.BoundArguments) -> torch.Tensor:
    args = dict(bound.arguments, past_key_values=_StopAtKeys())
    try:
        original(**args)
    except _Keys as keys:
        return keys.keys
    raise RuntimeError("cplib: the indexer returned without calling update_indexer; cplib "
                       "cannot score it over the whole sequence")


@torch.no_grad()
def _global_topk(original: Callable, bound: inspect.BoundArguments, call: SparseCall,
                 per_query: tuple[str, ...]) -> torch.Tensor:
    indexer = bound.arguments["self"]
    keys = all_rows(_own_keys(original, bound), call.rows)
    serve = _AllKeys(keys)
    q_pos, rows = call.q_pos, call.q_pos.numel()
    k_pos = torch.arange(call.rows.seq_len, device=keys.device)
    # Per query the indexer holds heads x S scores, and its matmul broadcasts
    # the keys to every query (head_dim x S).
    step = query_block(rows, max(int(getattr(indexer, "n_heads", 1)), keys.shape[-1]))
    out = []
    for a in range(0, rows, step):
        b = min(rows, a + step)
        args = {name: (_rows(v, a, b) if name in per_query else v)
                for name, v in bound.arguments.items()}
        see = visible(q_pos[a:b], k_pos, call.key_valid, call.cu_seqlens)
        args["attention_mask"] = see.expand(keys.shape[0], -1, -1)
        args["past_key_values"] = serve
        out.append(original(**args))
    return torch.cat(out, 1)


def indexer_forward(original: Callable, per_query: tuple[str, ...]) -> Callable:
    """The indexer's ``forward``: over the whole sequence in a sparse layer's
    call under context parallelism (module docstring); outside context
    parallelism, transformers' own."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        call = current()
        if call is None or call.module.indexer is not self:
            if active_config() is not None or layout_in_scope() is not None:
                raise NotImplementedError(
                    f"cplib: {type(self).__name__} was called under context parallelism "
                    "outside its attention layer: it would score this rank's keys alone; "
                    "call the model's own layers")
            return original(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        call.topk = _global_topk(original, bound, call, per_query)
        return call.topk

    forward.__cplib_original__ = original  # type: ignore[attr-defined]
    return forward
