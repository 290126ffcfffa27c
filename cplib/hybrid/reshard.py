"""Head re-sharding of per-token streams (Ulysses-style) in the context's
layout: every stream's sequence shard traded for the whole sequence on N-th
of its heads, in global order, and back. The exchanges are
``ulysses_reshard`` (one all-to-all per dtype among the streams: the delta
rule's gates stay in float32 beside bf16 projections), differentiable."""

from __future__ import annotations

import torch

from ..attention.layout import layout_indices
from ..ulysses.op import ulysses_reshard
from .layout import SequenceLayout

__all__ = ["sequence_to_heads", "heads_to_sequence"]


def _lengths(layout: SequenceLayout) -> list[int] | None:
    lengths = layout.lengths()
    return None if len(set(lengths)) == 1 else lengths


def _rank_major(layout: SequenceLayout, device) -> torch.Tensor | None:
    """Global positions in the order the ranks' shards concatenate, or None
    when that is the sequence order (sequential shards)."""
    if not layout.head_tail or layout.world_size == 1:
        return None
    return layout_indices(layout.seq_len, layout.world_size, True, device)


def sequence_to_heads(layout: SequenceLayout, streams: list[torch.Tensor]) -> list[torch.Tensor]:
    """(B, L_local, H, w) streams (one H, any widths and dtypes) -> (B, S, H/N, w)
    each, the whole sequence in order, this rank's heads."""
    order = _rank_major(layout, streams[0].device)
    out: list[torch.Tensor | None] = [None] * len(streams)
    for dtype in dict.fromkeys(s.dtype for s in streams):
        members = [i for i, s in enumerate(streams) if s.dtype == dtype]
        packed = torch.cat([streams[i] for i in members], dim=-1).transpose(1, 2)
        local = ulysses_reshard(packed, layout.group_name, to_heads=True,
                                lengths=_lengths(layout))
        if order is not None:
            local = local.index_select(2, torch.argsort(order))
        parts = local.transpose(1, 2).split([streams[i].shape[-1] for i in members], dim=-1)
        for i, part in zip(members, parts):
            out[i] = part
    return out  # type: ignore[return-value]


def heads_to_sequence(layout: SequenceLayout, x: torch.Tensor) -> torch.Tensor:
    """(B, S, H/N, w) on this rank's heads -> (B, L_local, H, w), this rank's
    shard of the sequence in the context's layout."""
    order = _rank_major(layout, x.device)
    x = x.transpose(1, 2)
    if order is not None:
        x = x.index_select(2, order)
    back = ulysses_reshard(x, layout.group_name, to_heads=False, lengths=_lengths(layout))
    return back.transpose(1, 2)
