"""``strategy="auto"`` for ``_ContextParallel(seq_dim, AttentionType.FLEX)``:
whether a module's flex calls run on the flex ring or the all-gather.

Explicit settings win, as for SDPA: the context's pinned rotation
(``AutoStrategy(rotate=...)``, or a rotation other than the default that
``set_rotate_method`` set when the module was parallelized) or one set at
the time of the call. Otherwise the choice is made once per (plan, group):
on the first call with a sharded BlockMask, every rank sends its row of the
plan (rows it receives from each rank, the cells of its mask blocks on each
rank's keys) through the strategy's handshake (ValueError on every rank if
the plans differ), so every rank builds the same :class:`FlexStats`, the
same Workload and the same cached, agreed choice (choice.agreed_choice).
While torch.compile traces, the ring runs (the choice is host work a graph
cannot hold; both paths compute the same result)."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ..attention.names import Layout
from ..strategy.auto import AutoStrategy
from ..strategy.choice import agreed_choice, calibration_for, every_rank
from ..strategy.explain import constraints_of
from ..strategy.candidates import FLEX
from ..strategy.flex_cost import FlexStats
from ..strategy.workload import Workload, element_size, ranks_per_node
from .plan import SHARD_ATTR, dense_block_map, dense_shard
from .call import parse_call

__all__ = ["flex_use_ring", "flex_stats"]

# The plan statistics of each FlexShard (one exchange per sharded mask).
_stats: "weakref.WeakKeyDictionary[Any, FlexStats]" = weakref.WeakKeyDictionary()


def _local_row(shard: Any, block_mask: Any, q: torch.Tensor) -> list[int]:
    """This rank's row of the plan: rows received from each rank, the cells
    of its partial and full mask blocks on each rank's keys (summed over
    batch and query heads), then the query rows of its call on each rank's
    keys."""
    n, L = shard.world, shard.q_len
    recv, q_rows = [0] * n, [0] * n
    for step in shard.steps:
        recv[step.src] += step.recv_rows
        if step.compute:
            q_rows[step.src] = step.q_rows[1] - step.q_rows[0]
    if block_mask is None:  # every key (dense_shard)
        cells = q.shape[0] * q.shape[1] * L * L
        return recv + [0] * n + [cells] * n + q_rows
    qb, kb = shard.block_size
    per_rank, total = L // kb, shard.kv_len // kb
    bm, hm, q_blocks = block_mask.kv_num_blocks.shape
    rows = (L - torch.arange(q_blocks) * qb).clamp(0, qb)  # rows of each query block
    spread = (q.shape[0] // bm) * (q.shape[1] // hm)  # a mask of 1 batch / head broadcasts

    def cells(num, idx) -> list[int]:
        if num is None:
            return [0] * n
        dense = dense_block_map(num, idx, total).view(bm, hm, q_blocks, n, per_rank).cpu()
        per_owner = (dense.sum(-1) * rows.view(1, 1, -1, 1)).sum((0, 1, 2))
        return [int(x) * kb * spread for x in per_owner.tolist()]

    return (recv + cells(block_mask.kv_num_blocks, block_mask.kv_indices)
            + cells(block_mask.full_kv_num_blocks, block_mask.full_kv_indices) + q_rows)


def flex_stats(shard: Any, block_mask: Any, q: torch.Tensor, group_name: str) -> FlexStats:
    """The plan of every rank (collective on the first call per shard: one
    handshake; cached on the shard after)."""
    found = _stats.get(shard)
    if found is not None:
        return found
    mine = _local_row(shard, block_mask, q)
    fields = {"strategy flex plan (hash)": int(shard.plan_hash),
              "strategy flex ranks": shard.world}
    every = every_rank(group_name, "strategy flex plan", fields, mine)
    n = shard.world
    stats = FlexStats(shard.q_len, *(tuple(tuple(row[i * n:(i + 1) * n]) for row in every)
                                      for i in range(4)))
    _stats[shard] = stats
    return stats


def _workload(stats: FlexStats, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              auto: AutoStrategy) -> Workload:
    n = stats.world
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return Workload(stats.q_len * n, int(q.shape[0]), int(q.shape[1]), int(k.shape[1]),
                    int(q.shape[3]), int(v.shape[3]), element_size(q.dtype), n,
                    ranks_per_node(n, auto.ranks_per_node), False, None, None,
                    str(Layout.SEQUENTIAL), q.device.type, grad, ((FLEX, stats),))


def flex_use_ring(auto: AutoStrategy | None, explicit: str | None, args: tuple, kwargs: dict,
                  group_name: str, world: int, rank: int, default: bool) -> bool:
    """Whether the flex calls of this FLEX module call (its arguments read as
    flex_attention's) run on the flex ring: ``default`` (the rotate method's)
    without a strategy; the explicit rotation where one is set (``explicit``:
    the front end's, cplib/frontend/options.py, else the strategy's); the
    all-gather for a mask whose plan the ring cannot serve; else the agreed
    choice of the cost model for the call's plan. Arguments that do not read
    as flex_attention's, or a mask without cplib's plan, go where they went
    without a strategy (where their errors are raised, on every rank)."""
    if auto is None:
        return default
    pinned = explicit or auto.rotate
    if pinned is not None:
        return pinned != "allgather"
    if torch.compiler.is_dynamo_compiling():
        return True
    try:
        call = parse_call(args, kwargs)
    except ValueError:
        return default
    mask = call.block_mask
    shard = (dense_shard(group_name, world, rank, call.query.shape[2], call.query.device)
             if mask is None else getattr(mask, SHARD_ATTR, None))
    if shard is not None and shard.unsupported is not None:
        return False  # a plan the ring cannot serve: the all-gather can
    if shard is None or call.query.dim() != 4 or call.key.dim() != 4 or call.value.dim() != 4:
        return default
    if mask is None:
        shard = _dense_key(shard, group_name, world, rank, call.query)
    q, k, v = call.query, call.key, call.value
    stats = flex_stats(shard, mask, q, group_name)  # eager: chosen outside a trace
    w = _workload(stats, q, k, v, auto)
    constraints = constraints_of(None, None, auto.memory_limit, world, (FLEX,),
                                 margin=auto.margin)
    choice = agreed_choice(group_name, w, constraints,
                           lambda: calibration_for(group_name, q.device, w.head_dim, q.dtype,
                                                   auto.calibration))
    auto.record(choice)
    return choice.chosen.rotate != "allgather"


_dense_shards: dict[tuple, Any] = {}


def _dense_key(shard: Any, group_name: str, world: int, rank: int, q: torch.Tensor) -> Any:
    """One dense plan per (group, rank, rows, device): the stats cache keys
    on the plan object, and a call without a mask makes a new one."""
    key = (group_name, world, rank, int(q.shape[2]), str(q.device))
    return _dense_shards.setdefault(key, shard)
