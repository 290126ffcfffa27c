"""The stand-in for a sharded BlockMask inside a context-parallel module.

A ``_ContextParallel(FLEX)`` module's flex call gets this rank's query,
key and value shards (L rows each) and the BlockMask ``_context_parallel_shard``
made, which covers L queries against all S keys. ``flex_attention`` would
refuse that pair (its mask checks compare lengths) before cplib sees the
call, so the module receives, in the mask's place, a stand-in: a BlockMask
of flex's "no block structure" size (whose lengths flex does not check)
whose mask_mod holds the sharded mask. cplib's mode (``cp_mode.py``) finds
it in the call and computes the call with the real mask. A stand-in that
reaches a flex kernel any other way (kept past the forward) raises there:
it never computes as a mask it is not."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask

__all__ = ["StandIn", "stand_in_for", "real_mask"]

_ATTR = "_cplib_stand_in"
# flex_attention's "one block covers everything" size: lengths go unchecked.
_NO_BLOCKS = 1 << 30


class StandIn:
    """The stand-in BlockMask's mask_mod: holds the sharded mask."""

    def __init__(self, mask: BlockMask) -> None:
        self.mask = mask

    def __call__(self, b, h, q_idx, kv_idx):
        raise RuntimeError(
            "cplib: the stand-in of a context-parallel BlockMask reached flex_attention outside "
            "its _ContextParallel module's forward; pass the sharded BlockMask to the module "
            "at each call (it is replaced for that call only)")


def stand_in_for(mask: BlockMask) -> BlockMask:
    """The stand-in of a sharded ``mask`` (made once, kept on the mask)."""
    found = getattr(mask, _ATTR, None)
    if found is None:
        device = mask.kv_num_blocks.device
        found = BlockMask.from_kv_blocks(
            torch.ones((1, 1, 1), dtype=torch.int32, device=device),
            torch.zeros((1, 1, 1, 1), dtype=torch.int32, device=device),
            BLOCK_SIZE=_NO_BLOCKS, mask_mod=StandIn(mask), seq_lengths=tuple(mask.seq_lengths))
        setattr(mask, _ATTR, found)
    return found


def real_mask(mask_mod: Any) -> BlockMask | None:
    """The sharded mask a call's mask_mod stands in for, or None."""
    return mask_mod.mask if isinstance(mask_mod, StandIn) else None
