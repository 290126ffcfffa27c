"""A context-parallel flex module's call parsed as flex_attention's, which
``strategy="auto"`` reads to price the call before the module runs
(strategy_route.py); what the module's flex calls themselves
receive is read where they are taken over (call.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = ["FLEX_PARAMS", "ParsedCall", "parse_call"]

# flex_attention's positional parameters, in order (return_aux is keyword-only).
FLEX_PARAMS = ("query", "key", "value", "score_mod", "block_mask", "scale", "enable_gqa",
               "return_lse", "kernel_options")


@dataclass
class ParsedCall:
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    score_mod: Callable | None = None
    block_mask: Any = None
    scale: float | None = None
    enable_gqa: bool = False
    return_lse: bool = False
    kernel_options: dict | None = None
    return_aux: Any = None


def parse_call(args: tuple, kwargs: dict) -> ParsedCall:
    """A module call's arguments read as flex_attention's; ValueError when
    they do not read so (the strategy then takes its default)."""
    if len(args) > len(FLEX_PARAMS):
        raise ValueError(f"cplib: {len(args)} positional arguments, more than flex_attention's "
                         f"{len(FLEX_PARAMS)}")
    bound = dict(zip(FLEX_PARAMS, args))
    for name, value in kwargs.items():
        if (name not in FLEX_PARAMS and name != "return_aux") or name in bound:
            raise ValueError(f"cplib: flex_attention takes no (second) argument `{name}`")
        bound[name] = value
    for i, name in enumerate(FLEX_PARAMS[:3]):
        if not isinstance(bound.get(name), torch.Tensor):
            raise ValueError(f"cplib: flex_attention's `{name}` (argument {i}) must be a tensor, "
                             f"got {type(bound.get(name)).__name__}")
    call = ParsedCall(**{k: v for k, v in bound.items() if v is not None or k == "block_mask"})
    call.enable_gqa = bool(call.enable_gqa)
    call.return_lse = bool(call.return_lse)
    return call
