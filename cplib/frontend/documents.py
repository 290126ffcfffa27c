"""Packed documents and sliding windows for SDPA: the batch's document
boundaries from Hugging Face style ``position_ids``, and the stacks of the
``attention_window`` / ``attention_documents`` blocks in effect
(attention_blocks.py; SDPA itself has no window argument)."""

from __future__ import annotations

from typing import Any

import torch

from ..attention.args import check_cu_seqlens
from ..attention.names import Layout

__all__ = ["cu_seqlens_from_position_ids", "context_documents", "current_window",
           "documents_stack", "windows_stack"]


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Document boundaries ``[0, s1, ..., S]`` (int64) of a packed sequence
    whose ``position_ids`` restart at 0 at each document, as Hugging Face
    packs them: shape ``(S,)`` or ``(B, S)`` with the same packing in every
    row (the ring takes one set of documents per call)."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() not in (1, 2):
        shape = tuple(position_ids.shape) if isinstance(position_ids, torch.Tensor) else \
            type(position_ids).__name__
        raise ValueError(f"cplib: position_ids must be a (S,) or (B, S) tensor, got {shape}")
    if position_ids.dtype.is_floating_point or position_ids.dtype == torch.bool:
        raise ValueError(f"cplib: position_ids must be integers, got dtype {position_ids.dtype}")
    rows = position_ids.reshape(-1, position_ids.shape[-1])
    if not bool((rows == rows[:1]).all()):
        raise NotImplementedError(
            "cplib: the batch rows of position_ids are packed differently; context-parallel "
            "SDPA takes one set of documents for the whole batch (pack every row alike, or "
            "run one row per call)"
        )
    row = rows[0].to("cpu", torch.long)
    if row.numel() == 0 or int(row[0]) != 0:
        raise ValueError(f"cplib: position_ids must start at 0 (the first document's first "
                         f"token), got {row[:8].tolist()}")
    starts = torch.nonzero(row == 0).flatten()
    return torch.cat([starts, torch.tensor([row.numel()])])


def context_documents(cu_seqlens: torch.Tensor | None, position_ids: torch.Tensor | None,
               seq_len: int | None) -> torch.Tensor | None:
    """``context_parallel``'s document boundaries, checked (ValueError naming
    the value, on every rank alike: every rank holds the same full batch)."""
    if cu_seqlens is not None and position_ids is not None:
        raise ValueError("cplib.context_parallel: pass cu_seqlens or position_ids, not both")
    if cu_seqlens is None and position_ids is None:
        return None
    if seq_len is None:
        raise ValueError("cplib.context_parallel: documents need the buffers to shard "
                         "(their length is the sequence length S)")
    if position_ids is not None:
        if position_ids.shape[-1] != seq_len:
            raise ValueError(f"cplib.context_parallel: position_ids cover "
                             f"{position_ids.shape[-1]} tokens but the buffers {seq_len}; pass "
                             "the full (unsharded) position_ids")
        cu_seqlens = cu_seqlens_from_position_ids(position_ids)
    check_cu_seqlens("context_parallel", cu_seqlens, seq_len)
    return cu_seqlens.to("cpu", torch.long)


# The documents of the SDPA calls of ``_ContextParallel`` modules made inside
# ``attention_documents`` blocks (cplib/frontend/style.py; a stack, so blocks
# nest): (cu_seqlens, the layout the shards are in where the documents cut
# it, Layout.PER_DOCUMENT or Layout.PLACEMENT, else None). A
# ``context_parallel`` region's calls take the region's documents and refuse
# these (cplib/frontend/sdpa_dispatch.py).
documents_stack: list[tuple[torch.Tensor, Layout | None]] = []

# The window of the SDPA calls made inside `attention_window` blocks
# (cplib/frontend/attention_blocks.py); a stack so blocks nest. Set and read
# on the caller's thread, at trace time under torch.compile (the window
# becomes a constant of the graph).
windows_stack: list[Any] = []


def current_window(default: Any) -> Any:
    """The innermost ``attention_window``, else ``default``."""
    return windows_stack[-1] if windows_stack else default
