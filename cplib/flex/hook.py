"""What ``_ContextParallel(seq_dim, AttentionType.FLEX)`` does to a module
whose forward is a flex_attention call, called like ``flex_attention(query,
key, value, score_mod, block_mask, scale, enable_gqa, return_lse,
kernel_options, *, return_aux)`` (q/k/v positionally or by keyword), with
the BlockMask this rank's shard (``_context_parallel_shard`` or
``create_cp_block_mask``). At each call, by ``_cp_options.rotate_method``
(``set_rotate_method``):

* ``"allgather"``: key and value are replaced by their all-gather over the
  mesh and the module's forward runs on them (torch's prototype);
* ``"p2p"`` / ``"alltoall"``: the flex ring (``ring.py``) computes the call
  from its arguments instead of the module's forward: each rank visits only
  the K/V rows its mask needs.

The front end passes the choice in (``use_ring``, given the call's
arguments: ``strategy="auto"`` chooses per plan): a feature folder does not
read the front end's options itself.

Either way score_mod sees global (original) positions when the mask was
sharded by cplib, as mask_mod does.
"""

from __future__ import annotations

import functools
import struct
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..comm.handshake import agreed
from ..comm.native import check_mesh, group_name_of
from .allgather import flex_cp_allgather
from .ring_args import ParsedCall, parse_call, ring_shard
from .ring import RingCall, ring_attention

__all__ = ["_flex_input_hook", "_register_flex_input_hook", "_flex_forward"]

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
    over ``group_name`` along ``seq_dim`` (gradients reduce-scatter back) and,
    when the block mask was sharded by cplib, score_mod by one that sees
    global positions; every other argument is passed through as it is."""
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
    _put(args_list, kwargs, {"key": key, "value": value})
    _globalize_score_mod(args_list, kwargs)
    return tuple(args_list), kwargs


def _put(args_list: list, kwargs: dict, values: dict[str, Any]) -> None:
    from .ring_args import FLEX_PARAMS

    for name, value in values.items():
        i = FLEX_PARAMS.index(name)
        if i < len(args_list):
            args_list[i] = value
        else:
            kwargs[name] = value


def _globalize_score_mod(args_list: list, kwargs: dict) -> None:
    """score_mod on global positions, for a block mask sharded by cplib
    (the all-gathered keys are in rearranged order, queries local)."""
    from .plan import SHARD_ATTR, positions_mod
    from .ring_args import FLEX_PARAMS

    def get(name: str) -> Any:
        i = FLEX_PARAMS.index(name)
        return args_list[i] if i < len(args_list) else kwargs.get(name)

    score_mod, block_mask = get("score_mod"), get("block_mask")
    shard = getattr(block_mask, SHARD_ATTR, None)
    if score_mod is None or shard is None:
        return
    _put(args_list, kwargs, {"score_mod": positions_mod(score_mod, shard.q_positions,
                                                        shard.positions, score=True)})


def _scale_bits(scale: float | None) -> int:
    return -1 if scale is None else struct.unpack("<q", struct.pack("<d", float(scale)))[0]


def _ring(call: ParsedCall, seq_dim: int, group_name: str, world: int, rank: int) -> Any:
    """The module's flex_attention call computed by the flex ring."""
    shard = agreed("flex_ring", group_name, [call.query, call.key, call.value],
                   lambda: ring_shard(call, seq_dim, world, rank, group_name))
    qb, kb = shard.block_size
    fields = {"block_mask is given": int(call.block_mask is not None),
              "block_mask q_len": shard.q_len, "block_mask kv_len": shard.kv_len,
              "block_mask BLOCK_SIZE[0]": qb, "block_mask BLOCK_SIZE[1]": kb,
              "ring plan (hash)": shard.plan_hash, "ring steps": len(shard.steps),
              "enable_gqa": int(call.enable_gqa), "score_mod is given": int(call.score_mod
                                                                            is not None),
              "scale (bits)": _scale_bits(call.scale)}
    for name in _QKV_NAMES:
        fields[f"{name} requires grad"] = int(getattr(call, name).requires_grad)
    ring = RingCall(shard, call.score_mod, call.scale, call.enable_gqa, call.kernel_options)
    out, lse = ring_attention(call.query, call.key, call.value, ring, fields, group_name)
    if call.return_aux is not None:
        from torch.nn.attention.flex_attention import AuxOutput
        return out, AuxOutput(lse=lse if call.return_aux.lse else None, max_scores=None)
    return (out, lse) if call.return_lse else out


def _flex_forward(forward: Any, *args: Any, seq_dim: int, group_name: str, world: int,
                  rank: int, use_ring: Callable[[tuple, dict], bool], **kwargs: Any) -> Any:
    """The parallelized module's forward: the ring when ``use_ring(args,
    kwargs)`` says so at the time of the call, else the all-gather."""
    if not use_ring(args, kwargs):
        args, kwargs = _flex_input_hook(None, args, kwargs, seq_dim=seq_dim,
                                        group_name=group_name)
        return forward(*args, **kwargs)
    parsed = agreed("flex_ring", group_name, [a for a in (*args, *kwargs.values())
                                              if isinstance(a, torch.Tensor)],
                    lambda: parse_call(args, kwargs))
    return _ring(parsed, seq_dim, group_name, world, rank)


def _register_flex_input_hook(module: nn.Module, mesh: DeviceMesh, seq_dim: int,
                              use_ring: Callable[[tuple, dict], bool] = lambda a, k: False
                              ) -> nn.Module:
    """Makes ``module`` (a flex_attention call) context parallel over the 1-D
    ``mesh``: its forward runs as the all-gather or, when ``use_ring(args,
    kwargs)`` (the call's arguments) at the time of a call, the ring (see
    the module docstring)."""
    # The group name is resolved once here, so compiled forwards see a string.
    group = check_mesh(mesh)
    module.forward = functools.partial(_flex_forward, module.forward, seq_dim=seq_dim,
                                       group_name=group.group_name,
                                       world=dist.get_world_size(group), rank=dist.get_rank(group),
                                       use_ring=use_ring)
    return module
