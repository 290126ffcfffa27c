"""The flex ring's arguments: a module call parsed as flex_attention's, and
the checks that every rank runs before the ring's first collective (their
errors reach every rank through the handshake)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.attention.flex_attention as fa

from .plan import SHARD_ATTR, FlexShard, dense_shard

__all__ = ["FLEX_PARAMS", "ParsedCall", "parse_call", "ring_shard"]

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
    """A module call's arguments as flex_attention's; ValueError naming what
    does not fit."""
    if len(args) > len(FLEX_PARAMS):
        raise ValueError(f"cplib: the context-parallel flex_attention module takes at most "
                         f"{len(FLEX_PARAMS)} positional arguments {FLEX_PARAMS}, got {len(args)}")
    bound = dict(zip(FLEX_PARAMS, args))
    for name, value in kwargs.items():
        if name not in FLEX_PARAMS and name != "return_aux":
            raise ValueError(f"cplib: the flex ring computes the module as flex_attention, which "
                             f"has no argument `{name}` (set_rotate_method('allgather') runs the "
                             "module's own forward)")
        if name in bound:
            raise ValueError(f"cplib: flex_attention argument `{name}` given twice")
        bound[name] = value
    for i, name in enumerate(FLEX_PARAMS[:3]):
        if not isinstance(bound.get(name), torch.Tensor):
            raise ValueError(
                f"cplib: the context-parallel flex_attention module needs `{name}` as a tensor "
                f"(argument {i} or keyword `{name}`), got {type(bound.get(name)).__name__}")
    call = ParsedCall(**{k: v for k, v in bound.items() if v is not None or k == "block_mask"})
    call.enable_gqa = bool(call.enable_gqa)
    call.return_lse = bool(call.return_lse)
    return call


def _check_tensors(call: ParsedCall, seq_dim: int) -> None:
    q, k, v = call.query, call.key, call.value
    for name, t in (("query", q), ("key", k), ("value", v)):
        if t.dim() != 4:
            raise ValueError(f"cplib: the flex ring needs 4-D (B, H, S, D) tensors; {name} has "
                             f"shape {tuple(t.shape)}")
        if not t.dtype.is_floating_point:
            raise ValueError(f"cplib: {name} has dtype {t.dtype}; expected a floating dtype")
        if t.device != q.device:
            raise ValueError(f"cplib: {name} is on {t.device} but query is on {q.device}")
    if seq_dim not in (2, -2):
        raise NotImplementedError(
            f"cplib: the flex ring shards (B, H, S, D) tensors on dim 2, got seq_dim={seq_dim} "
            "(set_rotate_method('allgather') gathers along any dim)")
    if k.dtype != v.dtype:
        raise ValueError(f"cplib: the flex ring sends key and value in one buffer, so they "
                         f"need one dtype, got {k.dtype} and {v.dtype}")
    if not (q.shape[2] == k.shape[2] == v.shape[2]):
        raise ValueError(f"cplib: query, key and value shards must have the same length, got "
                         f"{q.shape[2]}, {k.shape[2]} and {v.shape[2]}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]) or k.shape[1] != v.shape[1]:
        raise ValueError(f"cplib: query {tuple(q.shape)}, key {tuple(k.shape)} and value "
                         f"{tuple(v.shape)} disagree in batch or key/value heads")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"cplib: query and key must have the same embedding dimension, got "
                         f"E={q.shape[3]} and E={k.shape[3]}")
    hq, hkv = q.shape[1], k.shape[1]
    if (not call.enable_gqa and hq != hkv) or hq % hkv:
        raise ValueError(f"cplib: query has {hq} heads and key/value {hkv}; expected equal "
                         "counts, or a multiple with enable_gqa=True")


def _captured_grad_tensors(fn: Callable | None) -> list[str]:
    """Names of the tensors that require grad among ``fn``'s closure cells
    and partial arguments, followed into the callables found there (the ring
    does not differentiate captured tensors)."""
    found, seen, todo = [], set(), [fn]
    while todo:
        f = todo.pop()
        if not callable(f) or id(f) in seen:
            continue
        seen.add(id(f))
        items: list[tuple[str, Any]] = []
        if isinstance(f, functools.partial):
            items += [("a partial argument", a) for a in (*f.args, *f.keywords.values())]
            todo.append(f.func)
        code, cells = getattr(f, "__code__", None), getattr(f, "__closure__", None) or ()
        for name, cell in zip(code.co_freevars if code is not None else (), cells):
            try:
                items.append((name, cell.cell_contents))
            except ValueError:  # an empty cell
                pass
        for name, value in items:
            if isinstance(value, torch.Tensor):
                if value.requires_grad:
                    found.append(name)
            elif callable(value):
                todo.append(value)
    return found


def ring_shard(call: ParsedCall, seq_dim: int, world: int, rank: int,
               group_name: str) -> FlexShard:
    """Checks a ring call on this rank; returns its plan."""
    _check_tensors(call, seq_dim)
    if call.return_lse and call.return_aux is not None:
        raise ValueError("Cannot specify both return_lse and return_aux. return_lse is "
                         "deprecated, please use return_aux=AuxRequest(lse=True) instead.")
    if call.return_aux is not None and getattr(call.return_aux, "max_scores", False):
        raise NotImplementedError("cplib: the flex ring returns lse, not max_scores "
                                  "(set_rotate_method('allgather') for max_scores)")
    # Eager only: a traced closure's tensors are the graph's inputs, not values.
    captured = [] if torch.compiler.is_compiling() else _captured_grad_tensors(call.score_mod)
    if captured:
        raise NotImplementedError(
            f"cplib: score_mod captures tensors that require grad ({', '.join(captured)}); the "
            "flex ring does not differentiate captured tensors (set_rotate_method('allgather'))")
    fa._validate_device(call.query, call.key, call.value)  # torch's own (CPU backward) guard
    mask = call.block_mask
    if mask is None:
        return dense_shard(group_name, world, rank, call.query.shape[2], call.query.device)
    shard = getattr(mask, SHARD_ATTR, None)
    if not isinstance(mask, fa.BlockMask) or shard is None:
        raise ValueError(
            f"cplib: the flex ring needs the block mask of this rank's shard made by cplib "
            f"(_context_parallel_shard or create_cp_block_mask), got {type(mask).__name__} "
            "without cplib's shard layout; or set_rotate_method('allgather')")
    if (shard.world, shard.rank, shard.group_name) != (world, rank, group_name):
        raise ValueError(
            f"cplib: the block mask was sharded for rank {shard.rank} of {shard.world} on group "
            f"'{shard.group_name}', but this module runs on rank {rank} of {world} on group "
            f"'{group_name}'")
    if shard.unsupported is not None:
        raise NotImplementedError(f"cplib: {shard.unsupported}")
    if shard.q_len != call.query.shape[2]:
        raise ValueError(f"cplib: the block mask covers {shard.q_len} local queries but query "
                         f"has {call.query.shape[2]} rows")
    return shard
