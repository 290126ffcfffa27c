"""The forward pre-hook that makes a flex_attention module context parallel:
each rank keeps its query shard and attends to the all-gathered K/V.

The module is called like ``flex_attention(query, key, value, score_mod,
block_mask, scale, enable_gqa, return_lse, kernel_options, *, return_aux)``,
q/k/v positionally or by keyword. Only key and value are replaced (by their
gathered forms, unexpanded when GQA); every other argument passes through as
the very same object. The BlockMask must be this rank's shard (from
``_context_parallel_shard`` or ``_create_cp_block_mask``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .allgather import flex_cp_allgather
from ..comm.handshake import agreed
from ..comm.native import check_mesh, group_name_of

__all__ = ["_flex_input_hook", "_register_flex_input_hook"]

_QKV_NAMES = ("query", "key", "value")


def _flex_input_hook(
    module: nn.Module | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    seq_dim: int,
    group_name: str,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Returns ``(args, kwargs)`` with key/value replaced by their all-gather
    over ``group_name`` along ``seq_dim`` (gradients reduce-scatter back)."""
    args_list, kwargs = list(args), dict(kwargs)

    def find(i: int) -> torch.Tensor:
        name = _QKV_NAMES[i]
        t = args_list[i] if i < len(args_list) else kwargs.get(name)
        if not isinstance(t, torch.Tensor):
            raise ValueError(
                f"cplib: the context-parallel flex_attention module needs `{name}` as a tensor "
                f"(argument {i} or keyword `{name}`), got {type(t).__name__}"
            )
        return t

    def inputs() -> tuple[torch.Tensor, torch.Tensor]:
        find(0)  # the query stays local, but must be there
        return find(1), find(2)

    # A call rejected on one rank meets the others in their all-gather's handshake.
    given = [t for t in (*args_list, *kwargs.values()) if isinstance(t, torch.Tensor)]
    key, value = agreed("flex_cp_allgather", group_name_of(group_name), given, inputs)
    key, value = flex_cp_allgather(key, value, seq_dim, group_name)
    for i, t in ((1, key), (2, value)):
        if i < len(args_list):
            args_list[i] = t
        else:
            kwargs[_QKV_NAMES[i]] = t
    return tuple(args_list), kwargs


def _register_flex_input_hook(module: nn.Module, mesh: DeviceMesh, seq_dim: int) -> nn.Module:
    """Registers the CP flex input hook on ``module`` for the 1-D ``mesh``."""
    # The group name is resolved once here, so compiled forwards see a string.
    hook = functools.partial(
        _flex_input_hook, seq_dim=seq_dim, group_name=check_mesh(mesh).group_name
    )
    module.register_forward_pre_hook(hook, with_kwargs=True)
    return module
