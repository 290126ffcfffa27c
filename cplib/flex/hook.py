"""What ``_ContextParallel(seq_dim, AttentionType.FLEX)`` does to a module
whose forward calls ``flex_attention`` on this rank's query, key and value
shards, with the BlockMask ``_context_parallel_shard`` (or
``create_cp_block_mask``) made for this rank, or none.

The module's forward runs as written; each flex_attention call inside it
is computed over the whole sequence (``cp_mode.py``), by
``_cp_options.rotate_method`` (``set_rotate_method``) or, with
``strategy="auto"``, the strategy's choice for the call:

* ``"p2p"`` / ``"alltoall"``: the flex ring (``ring.py``): each rank visits
  only the K/V blocks its mask needs;
* ``"allgather"``: the keys and values are all-gathered inside the call.

For the call, the sharded mask is replaced in the module's arguments by its
stand-in (``stand_in.py``), which flex_attention accepts with local keys.
The front end passes the choice in (``use_ring``, given the module's
arguments) and the layout of the last ``_context_parallel_shard``
(``layout``): a feature folder does not read the front end's options.

``flex_input_hook`` is torch's pre-hook (``_ContextParallel.flex_input_fn``):
key and value arguments all-gathered, score_mod on global positions.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.attention.flex_attention as fa
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.flex_attention import BlockMask
from torch.utils._pytree import tree_map

from ..comm.handshake import agreed, share_error
from ..comm.native import check_mesh, group_name_of, ops
from .allgather import flex_cp_allgather
from .call import FLEX_PARAMS, flex_arg, put_flex_args
from .cp_mode import FlexCPMode, flex_modules_inside
from .plan import SHARD_ATTR, positions_mod
from .stand_in import stand_in_for

__all__ = ["flex_input_hook", "register_flex_cp"]


def flex_input_hook(
    module: nn.Module | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    seq_dim: int,
    group_name: str,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Returns ``(args, kwargs)`` with key/value replaced by their all-gather
    over ``group_name`` along ``seq_dim`` (gradients reduce-scatter back) and,
    when the block mask was sharded by cplib, score_mod by one that sees
    global positions; every other argument is passed through as it is."""
    args_list, kwargs = list(args), dict(kwargs)

    def find(i: int) -> torch.Tensor:
        name = FLEX_PARAMS[i]
        t = flex_arg(args_list, kwargs, name)
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
    put_flex_args(args_list, kwargs, {"key": key, "value": value})
    _globalize_score_mod(args_list, kwargs)
    return tuple(args_list), kwargs


def _globalize_score_mod(args_list: list, kwargs: dict) -> None:
    """score_mod on global positions, for a block mask sharded by cplib
    (the all-gathered keys are in rearranged order, queries local)."""
    score_mod = flex_arg(args_list, kwargs, "score_mod")
    shard = getattr(flex_arg(args_list, kwargs, "block_mask"), SHARD_ATTR, None)
    if score_mod is None or shard is None:
        return
    put_flex_args(args_list, kwargs, {"score_mod": positions_mod(
        score_mod, shard.q_positions, shard.positions, score=True)})


def _stand_in(x: Any) -> Any:
    """A BlockMask argument's stand-in (the mask itself stays with cplib)."""
    if not isinstance(x, BlockMask):
        return x
    if getattr(x, SHARD_ATTR, None) is None:
        raise ValueError(
            "cplib: a context-parallel flex module got a BlockMask that cplib did not shard: "
            "pass the mask that _context_parallel_shard or create_cp_block_mask made "
            "(eagerly: a mask made while torch.compile traces carries no layout)")
    return stand_in_for(x)


def _flex_forward(forward: Any, mode: FlexCPMode, use_ring: Callable[[tuple, dict], bool],
                  layout: Callable[[], torch.Tensor | None], *args: Any, **kwargs: Any) -> Any:
    """The parallelized module's forward: its own, with its flex calls taken
    over (``mode``), their BlockMask arguments replaced by stand-ins."""
    mode.ring, mode.layout = use_ring(args, kwargs), layout()

    def run() -> Any:
        given = tree_map(_stand_in, (args, kwargs), is_leaf=lambda x: isinstance(x, BlockMask))
        with flex_modules_inside(), mode:
            return forward(*given[0], **given[1])

    if torch.compiler.is_dynamo_compiling():  # (is_compiling(): any thread's compile)
        return run()
    begun = ops.flex_debug_calls_begun()
    try:
        return run()
    except Exception as exc:
        # Raised in a flex call (flex's own checks, a compile of the call, a
        # mask cplib did not shard) before this rank began any flex
        # collective: the other ranks are in (or on their way to) that call's
        # handshake, which raises it there too. An error of the module's own
        # code is the module's: nothing says the others reach a flex call.
        if ops.flex_debug_calls_begun() == begun and _in_a_flex_call(exc):
            share_error("flex_ring", mode.group_name, exc)
        raise


def _in_a_flex_call(exc: BaseException) -> bool:
    """``exc`` came through flex_attention, a compiled function (a
    compiled flex, or flex's own compile of its call) or the stand-in check."""
    codes = (fa.flex_attention.__code__, _stand_in.__code__)
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code in codes or code.co_filename.endswith(_DYNAMO_ENTRY):
            return True
        tb = tb.tb_next
    return False


# The file of dynamo's compiled-function entry (compile_wrapper): every error
# of a compiled call, its compile included, passes through it.
_DYNAMO_ENTRY = "_dynamo/eval_frame.py"


def register_flex_cp(module: nn.Module, mesh: DeviceMesh,
                      use_ring: Callable[[tuple, dict], bool] = lambda a, k: True,
                      layout: Callable[[], torch.Tensor | None] = lambda: None) -> nn.Module:
    """Makes ``module``'s flex_attention calls context parallel over the 1-D
    ``mesh``: on the ring when ``use_ring(args, kwargs)`` (the module's
    arguments) says so at the time of a call, else on the all-gather;
    ``layout()``: the sequence's layout when no BlockMask gives it (see the
    module docstring)."""
    # The group is resolved once here, so compiled forwards see a string.
    group = check_mesh(mesh)
    mode = FlexCPMode(group.group_name, dist.get_world_size(group), dist.get_rank(group))
    module.forward = functools.partial(_flex_forward, module.forward, mode, use_ring, layout)
    return module
