"""Registration for ``cplib_c::merge_partial_``, the fused in-place merge of a
partial attention result (block out, block lse) into running (out, lse)."""

from __future__ import annotations

import torch

from ..comm.native import ops, reject_mixed_meta, reject_real_in_fake

__all__ = ["merge_partial_"]


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
