"""``strategy="auto"`` inside the front end: the entry of ``context_parallel``
(with the attention's shape: the Ulysses degree and the rotation, before the
buffers are sharded) and each SDPA call routed by ``context_parallel`` /
``_ContextParallel`` (the rotation of the context's ring or USP, for the
shapes of the call; the Ulysses degree is fixed there by how the inputs are
sharded)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import torch

from ..attention.args import window_arg
from ..attention.names import Layout
from ..strategy.auto import AutoStrategy, choose_for_call, workload_from_call
from ..strategy.candidates import Candidate, data_layout
from ..strategy.choice import agreed_choice, calibration_for
from ..strategy.explain import constraints_of, workload_of
from ..strategy.plan import layout_load_balance

__all__ = ["strategy_entry", "context_strategy", "entry_choice", "routed_config"]


def context_strategy(auto: AutoStrategy | None, group_name: str, rotate: str | None,
                     ulysses_degree: int) -> AutoStrategy | None:
    """The strategy of one context with its explicit settings pinned: the
    rotation the front end found explicit (``explicit_rotation`` in
    cplib/frontend/options.py) and a Ulysses degree other than 1."""
    if auto is None:
        return None
    return auto.pinned(rotate=rotate, ulysses_degree=ulysses_degree if ulysses_degree != 1
                       else None, group=group_name)


def strategy_entry(auto: AutoStrategy | None, planned: Any, plan: Callable[..., Any],
                   group_name: str, device_type: str, explicit_rotate: str | None,
                   ulysses_degree: int) -> tuple:
    """``context_parallel``'s strategy step, after its arguments are agreed:
    (the context's strategy, the strategy of its SDPA calls, the plan).
    ``planned`` is ``_plan``'s result (cplib/frontend/context_parallel.py:
    ContextPlan) and ``plan(u, rotate)`` makes it again for a chosen Ulysses
    degree and rotation; ``explicit_rotate``: the rotation the caller set
    explicitly (it wins), or None."""
    if auto is None:
        return None, None, planned
    auto = context_strategy(auto, group_name, explicit_rotate, ulysses_degree)
    # Head-tail (the default balancing) leaves the layout to the model; any
    # other is fixed.
    layout = None if planned.layout == Layout.HEAD_TAIL else str(planned.layout)
    chosen = entry_choice(auto, group_name, planned.ring_degree * ulysses_degree,
                          planned.seq_len, planned.documents, planned.window, device_type,
                          layout)
    if chosen is None:
        return auto, auto, planned
    # A registered layout (a document placement) shards by its own load_balance.
    balance = layout_load_balance(chosen.layout)
    args = (chosen.ulysses_degree, chosen.rotate) if chosen.rotate else (chosen.ulysses_degree,)
    return auto, None, plan(*args, balance=balance) if balance is not None else plan(*args)


def entry_choice(auto: AutoStrategy, group_name: str, world_size: int, seq_len: int | None,
                 documents: torch.Tensor | None, window: list[int] | None,
                 device_type: str, layout: str | None) -> Candidate | None:
    """The candidate chosen on entry of ``context_parallel`` from
    ``auto.attention`` (its Ulysses degree, rotation and layout); None
    without it (the rotation is then chosen per call, for the degree given).
    Collective on a miss (calibration, the agreed choice): call it on every
    rank, after the arguments are agreed."""
    shape = auto.attention
    if shape is None or seq_len is None:
        return None
    w = workload_of(seq_len=seq_len, q_heads=shape.q_heads, head_dim=shape.head_dim,
                    world_size=world_size, kv_heads=shape.kv_heads, batch=shape.batch,
                    dtype=shape.dtype, is_causal=shape.is_causal,
                    window=None if window is None else tuple(window),
                    cu_seqlens=documents, node_ranks=auto.ranks_per_node,
                    device_type=device_type, layout=layout)
    constraints = constraints_of(auto.rotate, auto.ulysses_degree, auto.memory_limit,
                                 world_size, auto.families, margin=auto.margin)
    device = torch.device(device_type)
    choice = agreed_choice(group_name, w, constraints,
                           lambda: calibration_for(group_name, device, shape.head_dim,
                                                   shape.dtype, auto.calibration))
    auto.record(choice)
    return choice.chosen


def routed_config(config: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  is_causal: bool, window: Any) -> Any:
    """``config`` (the front end's RingConfig) with the rotation
    ``config.strategy`` chooses for this call (unchanged for pure Ulysses,
    which has no ring)."""
    auto: AutoStrategy = config.strategy
    n, u = config.world_size, config.ulysses_degree
    if u == n or torch.compiler.is_compiling():  # traced: the context's rotation
        return config

    layout = str(config.layout)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    # q is this rank's shard of S / N rows for every head (before Ulysses).
    w = workload_from_call(q, k, v, n, is_causal=is_causal, window=window_arg(window),
                           seq_len=config.seq_len, layout=layout, backward=grad,
                           node_ranks=auto.ranks_per_node)
    family = ("ring",) if u == 1 else ("usp",)
    group = auto.group or config.group_name
    # The degree is how the inputs were sharded: only the rotation is free.
    chosen = choose_for_call(replace(auto, ulysses_degree=u), group, w, config.cu_seqlens, q,
                             family,
                             data_layout(layout, n // u))
    if chosen.rotate is None or chosen.rotate == config.rotate:
        return config
    return replace(config, rotate=chosen.rotate)
