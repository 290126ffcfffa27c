"""Registration for ``cplib_c::merge_partial_``, the fused in-place merge of a
partial attention result (block out, block lse) into running (out, lse), and
for ``cplib_c::combine_partials_``, the one-pass combine of several partial
results (the ring's steps) that writes each row once."""

from __future__ import annotations

import torch

from ..comm.native import ops, reject_mixed_meta, reject_real_in_fake

__all__ = ["combine_partials_", "merge_partial_"]


@torch.library.register_fake("cplib_c::merge_partial_")
def _merge_fake(out, lse, blk_out, blk_lse, row_offset=0):
    reject_real_in_fake("merge_partial_", out, lse, blk_out, blk_lse)
    return None


def merge_partial_(
    out: torch.Tensor,
    lse: torch.Tensor,
    blk_out: torch.Tensor,
    blk_lse: torch.Tensor,
    row_offset: int = 0,
) -> None:
    """Merges ``(blk_out, blk_lse)`` into rows ``[row_offset, row_offset + rows)``
    of ``(out, lse)`` in place: ``lse = logaddexp(lse, blk_lse)`` and ``out`` the
    matching softmax-weighted mix. ``out``/``lse`` are float32 or float64."""
    reject_mixed_meta("merge_partial_", out=out, lse=lse, blk_out=blk_out, blk_lse=blk_lse)
    ops.merge_partial_(out, lse, blk_out, blk_lse, row_offset)


@torch.library.register_fake("cplib_c::combine_partials_")
def _combine_fake(out, lse, parts, lses, row_offsets):
    reject_real_in_fake("combine_partials_", out, lse, *parts, *lses)
    return None


def combine_partials_(
    out: torch.Tensor,
    lse: torch.Tensor | None,
    parts: list[torch.Tensor],
    lses: list[torch.Tensor] | None,
    row_offsets: list[int],
) -> None:
    """Writes into ``out`` (B, H, L, D) the combination of ``parts`` (each
    (B, H, rows, D), covering rows ``[row_offset, row_offset + rows)``): with
    ``lses`` (each part's (B, H, rows) log-sum-exp, float32 or float64) the
    softmax-weighted one, its log-sum-exp into ``lse``; without, their sum.
    Computed in float32 (float64 for float64 out) and rounded once into
    ``out``'s dtype; a row no part covers gets 0 (and lse -inf)."""
    lses = list(lses or [])
    if lses and lse is None:
        raise ValueError("cplib.combine_partials_: a weighted combine needs an lse to write")
    ref = lse if lse is not None else out.new_empty(0)
    reject_mixed_meta("combine_partials_", out=out, lse=ref,
                      **{f"part{j}": t for j, t in enumerate(parts)})
    ops.combine_partials_(out, ref, list(parts), lses, list(row_offsets))
