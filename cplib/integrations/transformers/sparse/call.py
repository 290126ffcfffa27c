"""One sparse layer's call under context parallelism: what its parts
(layer.py, indexer.py, attend.py) hand each other while the model's own
forward runs, and where the layout comes from.

The layer's wrapper opens the call; the layer's ``expand_kv`` leaves its
latents in it, the indexer its top-k (global positions), and the attention
function transformers looks up (attention_guard.py asks
:func:`attention_taken_over`) reads both. Per thread, like the dispatch
mode that marks the context; nothing outlives the layer's forward.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ....frontend.sequence import SequenceShards
from ....frontend.sharding import shard_tensor
from ....ring.load_balancer import shard_lengths
from ....sparse import RowLayout

__all__ = ["SparseCall", "current", "open_call", "close_call", "attention_taken_over",
           "row_layout"]


@dataclass
class SparseCall:
    module: Any  # the attention layer
    what: str  # "DeepseekV32Attention (deepseek_v32)", for errors
    rows: RowLayout  # every rank's global positions
    q_pos: torch.Tensor  # this rank's global positions, on the model's device
    key_valid: torch.Tensor | None  # (B, S) over the whole sequence; None: no padding
    cu_seqlens: torch.Tensor | None  # the context's documents
    attention: Callable[..., Any]  # what the layer's interface lookup returns
    latents: tuple[torch.Tensor, torch.Tensor] | None = None  # (k_pass, k_rot), local
    expand: Callable[..., Any] | None = None  # the layer's own expand_kv, bound
    topk: torch.Tensor | None = None  # (B, L, K) global positions, -1 none
    plan: Any = None  # the rows' plan of the attention (cplib.sparse.RowsPlan)


_current: contextvars.ContextVar[SparseCall | None] = contextvars.ContextVar(
    "cplib_sparse_call", default=None)


def current() -> SparseCall | None:
    # A trace never holds a sparse call (layer.py runs them eagerly), and
    # dynamo cannot read a ContextVar: a compiled dense model asks here too.
    return None if torch.compiler.is_compiling() else _current.get()


def open_call(call: SparseCall) -> contextvars.Token:
    return _current.set(call)


def close_call(token: contextvars.Token) -> None:
    _current.reset(token)


def attention_taken_over() -> Callable[..., Any] | None:
    """The attention function of the sparse layer running now under context
    parallelism (None: no such layer)."""
    call = current()
    return None if call is None else call.attention


def row_layout(shards: SequenceShards, device: torch.device) -> tuple[RowLayout, torch.Tensor]:
    """(every rank's rows, this rank's global positions on ``device``) of
    ``shards``' layout. A layout that permutes each batch row its own way
    (per document) raises NotImplementedError."""
    lb, n, seq_len = shards.load_balancer, shards.mesh.size(), shards.seq_len
    indices = None if lb is None else lb._generate_indices()
    if indices is not None and indices.shape[0] != 1:
        raise NotImplementedError(
            "cplib: sparse attention under context parallelism takes layouts that cut every "
            "batch row alike (sequential, head-tail); this one permutes each row its own way")
    lengths = shard_lengths(seq_len, n, lb)
    full = torch.arange(seq_len)
    positions = tuple(shard_tensor(full, 0, r, n, indices, lengths) for r in range(n))
    rank = shards.mesh.get_local_rank()
    layout = RowLayout(positions, rank, shards.group.group_name if n > 1 else None, seq_len)
    return layout, positions[rank].to(device)
