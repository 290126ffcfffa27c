"""One ``flex_attention`` call as the flex higher-order op receives it
(``torch.ops.higher_order.flex_attention(query, key, value, score_mod,
block_mask.as_tuple(), scale, kernel_options, ...)``), which is where
cplib takes a context-parallel module's call over (``cp_mode.py``): by then
``flex_attention`` has validated its arguments, filled in the defaults
(the scale, an empty BlockMask, the identity score_mod) and resolved its
kernel options, and the op returns ``(out, lse, max_scores)`` with the
statistics in base 2 unless the backend is FLASH.

This module reads such a call and gives back results in the op's
conventions, so that the ``flex_attention`` around it (and the module
around that) sees what one process would give it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.attention.flex_attention as fa

__all__ = ["FlexCall", "parse_hop_call", "is_graph_call", "hop_outputs", "public_options"]

# Entries flex_attention adds to the caller's kernel options (it refuses
# them from a caller): dropped before a call of our own.
_INTERNAL_OPTIONS = ("OUTPUT_LOGSUMEXP", "OUTPUT_MAX")


@dataclass
class FlexCall:
    """A flex call's arguments, read off the op's."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    score_mod: Callable | None    # None: flex's identity (no score_mod given)
    mask_mod: Any                 # the BlockMask's mask_mod (the last entry of its tuple)
    mask_tuple: tuple             # block_mask.as_tuple(), as the op got it
    scale: float
    kernel_options: dict          # as resolved by flex_attention
    output_lse: bool              # flex computes the lse (asked for, or for a backward)
    output_max: bool              # max_scores asked for

    @property
    def enable_gqa(self) -> bool:
        return self.query.shape[1] != self.key.shape[1]

    @property
    def options(self) -> dict:
        """The caller's kernel options, as a call of flex_attention takes them."""
        return public_options(self.kernel_options)

    @property
    def stats_are_log2(self) -> bool:
        """The op's lse and max_scores are in base 2 (every backend but FLASH)."""
        return self.kernel_options.get("BACKEND") != "FLASH"


def public_options(kernel_options: dict | None) -> dict | None:
    if kernel_options is None:
        return None
    return {k: v for k, v in kernel_options.items() if k not in _INTERNAL_OPTIONS}


def is_graph_call(mask_tuple: tuple) -> bool:
    """The op called from a graph that torch.compile made (its mask_mod is
    that graph's submodule): a call some trace already took over, or one
    of ours, which runs as it is."""
    return isinstance(mask_tuple[-1], torch.fx.GraphModule)


def parse_hop_call(args: tuple, kwargs: dict) -> FlexCall:
    names = ("query", "key", "value", "score_mod", "block_mask", "scale", "kernel_options",
             "score_mod_other_buffers", "mask_mod_other_buffers")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    for extra in names[7:]:
        if bound.get(extra):
            raise NotImplementedError(
                f"cplib: a flex_attention call with {extra} (captured tensors lifted out of "
                "its score_mod or mask_mod) reached a context-parallel module: call "
                "flex_attention itself, not its higher-order op")
    score_mod = bound["score_mod"]
    options = dict(bound["kernel_options"])
    mask_tuple = tuple(bound["block_mask"])
    return FlexCall(bound["query"], bound["key"], bound["value"],
                    None if score_mod is fa._identity else score_mod, mask_tuple[-1], mask_tuple,
                    bound["scale"], options, bool(options.get("OUTPUT_LOGSUMEXP", True)),
                    bool(options.get("OUTPUT_MAX", False)))


def hop_outputs(call: FlexCall, out: torch.Tensor, lse: torch.Tensor) -> tuple:
    """``(out, lse, max_scores)`` as the op returns them, from an output and
    a natural-log lse (flex_attention scales a base-2 lse back by ln 2)."""
    if call.stats_are_log2:
        lse = lse * (1.0 / math.log(2.0))
    return out, lse, out.new_empty((0,), dtype=lse.dtype)
