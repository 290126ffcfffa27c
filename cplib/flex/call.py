"""One ``flex_attention`` call, read by one parser into one record
(``FlexCall``), from either of the two places cplib sees it:

* flex's higher-order op (``torch.ops.higher_order.flex_attention(query,
  key, value, score_mod, block_mask.as_tuple(), scale, kernel_options,
  ...)``: :func:`parse_hop_call`), which is where cplib takes a
  context-parallel module's call over (``cp_mode.py``): by then
  ``flex_attention`` has validated its arguments, filled in the defaults
  (the scale, an empty BlockMask, the identity score_mod) and resolved its
  kernel options, and the op returns ``(out, lse, max_scores)`` with the
  statistics in base 2 unless the backend is FLASH;
* a context-parallel module's own arguments, in ``flex_attention``'s
  signature (:func:`parse_call`, :func:`flex_arg`), before its forward runs:
  what ``strategy="auto"`` prices (strategy_route.py) and where torch's
  all-gather pre-hook replaces key and value (hook.py).

:func:`hop_outputs` gives results back in the op's conventions, so that the
``flex_attention`` around it (and the module around that) sees what one
process would give it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.attention.flex_attention as fa

__all__ = ["FlexCall", "FLEX_PARAMS", "parse_hop_call", "parse_call", "flex_arg",
           "put_flex_args", "is_graph_call", "hop_outputs", "public_options"]

# flex_attention's positional parameters, in order (return_aux is keyword-only).
FLEX_PARAMS = ("query", "key", "value", "score_mod", "block_mask", "scale", "enable_gqa",
               "return_lse", "kernel_options")
# The op's parameters, in order.
_HOP_PARAMS = ("query", "key", "value", "score_mod", "block_mask", "scale", "kernel_options",
               "score_mod_other_buffers", "mask_mod_other_buffers")
# Entries flex_attention adds to the caller's kernel options (it refuses
# them from a caller): dropped before a call of our own.
_INTERNAL_OPTIONS = ("OUTPUT_LOGSUMEXP", "OUTPUT_MAX")


@dataclass
class FlexCall:
    """A flex call's arguments. Read off the op (:func:`parse_hop_call`):
    ``mask_tuple`` is the BlockMask's tuple as the op got it, the kernel
    options as flex resolved them, ``score_mod`` None for flex's identity.
    Read off a module's arguments (:func:`parse_call`): ``block_mask`` is the
    BlockMask given (None: none), the rest as given (None: not given)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    score_mod: Callable | None = None
    block_mask: Any = None        # a module call's BlockMask argument
    mask_tuple: tuple = ()        # an op call's block_mask.as_tuple()
    scale: float | None = None
    kernel_options: dict | None = None
    output_lse: bool = False      # the lse is computed (op: asked for or for a backward)
    output_max: bool = False      # max_scores asked for (op)

    @property
    def mask_mod(self) -> Any:
        """An op call's BlockMask's mask_mod (the last entry of its tuple)."""
        return self.mask_tuple[-1]

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
    """The op's arguments; NotImplementedError for captured tensors lifted
    out of score_mod / mask_mod (a call of the op itself, not of flex_attention)."""
    bound = dict(zip(_HOP_PARAMS, args))
    bound.update(kwargs)
    for extra in _HOP_PARAMS[7:]:
        if bound.get(extra):
            raise NotImplementedError(
                f"cplib: a flex_attention call with {extra} (captured tensors lifted out of "
                "its score_mod or mask_mod) reached a context-parallel module: call "
                "flex_attention itself, not its higher-order op")
    score_mod = bound["score_mod"]
    options = dict(bound["kernel_options"])
    return FlexCall(bound["query"], bound["key"], bound["value"],
                    score_mod=None if score_mod is fa._identity else score_mod,
                    mask_tuple=tuple(bound["block_mask"]), scale=bound["scale"],
                    kernel_options=options,
                    output_lse=bool(options.get("OUTPUT_LOGSUMEXP", True)),
                    output_max=bool(options.get("OUTPUT_MAX", False)))


def parse_call(args: tuple, kwargs: dict) -> FlexCall:
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
    return FlexCall(bound["query"], bound["key"], bound["value"],
                    score_mod=bound.get("score_mod"), block_mask=bound.get("block_mask"),
                    scale=bound.get("scale"), kernel_options=bound.get("kernel_options"),
                    output_lse=bool(bound.get("return_lse")))


def flex_arg(args: Sequence, kwargs: dict, name: str) -> Any:
    """Argument ``name`` of a call in flex_attention's signature, positional
    or keyword (None: not given)."""
    i = FLEX_PARAMS.index(name)
    return args[i] if i < len(args) else kwargs.get(name)


def put_flex_args(args_list: list, kwargs: dict, values: dict[str, Any]) -> None:
    """Replaces the arguments named in ``values`` (flex_attention's names)
    where the call passed them: positionally in ``args_list``, else by keyword."""
    for name, value in values.items():
        i = FLEX_PARAMS.index(name)
        if i < len(args_list):
            args_list[i] = value
        else:
            kwargs[name] = value


def hop_outputs(call: FlexCall, out: torch.Tensor, lse: torch.Tensor) -> tuple:
    """``(out, lse, max_scores)`` as the op returns them, from an output and
    a natural-log lse (flex_attention scales a base-2 lse back by ln 2)."""
    if call.stats_are_log2:
        lse = lse * (1.0 / math.log(2.0))
    return out, lse, out.new_empty((0,), dtype=lse.dtype)
