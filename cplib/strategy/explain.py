"""``cplib.explain``: the table of candidates for one attention call, with
predicted time, bytes and memory, the chosen one marked."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ..attention.args import check_cu_seqlens, window_arg
from .calibration import Calibration
from .candidates import Constraints
from .choice import Choice, calibration_for, choose, format_choice
from .workload import NO_LIMIT, Workload, element_size, ranks_per_node

__all__ = ["explain", "format_choice", "workload_of", "constraints_of", "DEFAULT_MARGIN"]

# The predicted gain a candidate needs to replace torch's default (the ring
# with all-gather): about the model's error on the CPU sweep
# (benchmarks/RESULTS.md), so that auto leaves the default only when it is
# confident.
DEFAULT_MARGIN = 0.05


def _sides(window: Any, causal: bool) -> tuple[int, int] | None:
    if window is None:
        return None

    left, right = window_arg(window)
    return (min(left, NO_LIMIT), 0 if causal else min(right, NO_LIMIT))


def workload_of(*, seq_len: int, q_heads: int, head_dim: int, world_size: int,
                kv_heads: int | None = None, v_head_dim: int | None = None, batch: int = 1,
                dtype: torch.dtype = torch.bfloat16, is_causal: bool = True, window: Any = None,
                cu_seqlens: Any = None, node_ranks: int | None = None,
                device_type: str = "cuda", layout: str | None = None,
                backward: bool = True) -> Workload:
    """A Workload from global shapes (ValueError naming a bad one)."""
    for name, value in (("seq_len", seq_len), ("q_heads", q_heads), ("head_dim", head_dim),
                        ("world_size", world_size), ("batch", batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"cplib.explain: {name}={value!r} must be a positive int")
    kv_heads = q_heads if kv_heads is None else kv_heads
    if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads < 1 \
            or q_heads % kv_heads:
        raise ValueError(f"cplib.explain: kv_heads={kv_heads!r} must divide q_heads={q_heads}")
    if seq_len < world_size:
        raise ValueError(f"cplib.explain: seq_len={seq_len} is shorter than the world size "
                         f"{world_size}")
    docs = None
    if cu_seqlens is not None:

        cu = cu_seqlens if isinstance(cu_seqlens, torch.Tensor) else torch.tensor(cu_seqlens)
        check_cu_seqlens("explain", cu, seq_len)
        docs = tuple(int(x) for x in cu.tolist())
    return Workload(seq_len, batch, q_heads, kv_heads, head_dim,
                    head_dim if v_head_dim is None else v_head_dim, element_size(dtype),
                    world_size, ranks_per_node(world_size, node_ranks), bool(is_causal),
                    _sides(window, bool(is_causal)), docs, layout, device_type, backward)


def explain(context: Any = None, *, seq_len: int | None = None, q_heads: int | None = None,
            head_dim: int | None = None, world_size: int | None = None,
            group: Any = None, kv_heads: int | None = None, v_head_dim: int | None = None,
            batch: int = 1, dtype: torch.dtype = torch.bfloat16, is_causal: bool = True,
            window: Any = None, cu_seqlens: Any = None, ranks_per_node: int | None = None,
            device_type: str | None = None, layout: str | None = None, backward: bool = True,
            calibration: Calibration | str | Mapping[str, float] | None = None,
            memory_limit: int | None = None, rotate: str | None = None,
            ulysses_degree: int | None = None, margin: float = DEFAULT_MARGIN
            ) -> Choice | list[Choice]:
    """The candidates for one attention call of global shape (``batch``,
    ``q_heads`` / ``kv_heads``, ``seq_len``, ``head_dim``) over ``world_size``
    ranks (or ``group``'s size), costed and chosen as ``strategy="auto"``
    would; ``print(cplib.explain(...))`` shows the table.

    ``calibration``: a Calibration, a built-in default's name ("h100",
    "cpu") or a dict of overrides; None: the group's measured one when
    ``group`` is given (measured now if not cached: collective, call it on
    every rank), else the device's default. ``memory_limit`` (bytes per
    rank), ``rotate`` and ``ulysses_degree`` constrain the choice as explicit
    settings do; ``margin``: torch's default (the ring with all-gather) is kept
    unless another candidate is predicted more than this much faster.
    ``layout``: the layout the shards are in (a
    cplib.attention.names.Layout's name: "head_tail", "sequential",
    "per_document", "placement"), None to let the candidates choose.

    ``explain(cp)``, for the handle of a ``context_parallel(...,
    strategy="auto")`` block, returns the choices made in it so far (one per
    distinct attention call; ``print`` each for its table); ``explain(style)``,
    for a ``_ContextParallel(..., strategy="auto")``, the choices its modules
    made (FLEX: the flex ring or all-gather, one per sharded BlockMask's plan)."""
    if context is not None:
        if callable(getattr(context, "explain", None)):  # a _ContextParallel
            return context.explain()
        strategy = getattr(context, "strategy", None)
        if not hasattr(context, "unshard"):
            raise ValueError("cplib.explain: the positional argument must be the handle of a "
                             f"context_parallel block, got {type(context).__name__}")
        return [] if strategy is None else strategy.explain()
    if seq_len is None or q_heads is None or head_dim is None:
        raise ValueError("cplib.explain: pass seq_len=, q_heads= and head_dim= (or the handle "
                         "of a context_parallel block)")
    from ..comm.native import group_name_of, group_size

    name = None if group is None else group_name_of(group)
    n = world_size if world_size is not None else (group_size(name) if name else None)
    if n is None:
        raise ValueError("cplib.explain: pass world_size= or group=")
    device_type = device_type or ("cuda" if calibration in (None, "h100") and name is None
                                  else "cpu")
    w = workload_of(seq_len=seq_len, q_heads=q_heads, head_dim=head_dim, world_size=n,
                    kv_heads=kv_heads, v_head_dim=v_head_dim, batch=batch, dtype=dtype,
                    is_causal=is_causal, window=window, cu_seqlens=cu_seqlens,
                    node_ranks=ranks_per_node, device_type=device_type, layout=layout,
                    backward=backward)
    constraints = constraints_of(rotate, ulysses_degree, memory_limit, n, margin=margin)
    cal = calibration_for(name, torch.device(device_type), head_dim, dtype, calibration)
    return choose(w, cal, constraints)


def constraints_of(rotate: str | None, ulysses_degree: int | None, memory_limit: int | None,
                   world_size: int, families: tuple[str, ...] | None = None,
                   data_layout: tuple | None = None, margin: float = 0.0) -> Constraints:
    """Constraints from explicit settings, each checked (ValueError naming it)."""
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise ValueError(f"cplib.strategy: margin={margin!r} must be a number in [0, 1)")
    from .candidates import ROTATIONS

    if rotate is not None and rotate not in ROTATIONS:
        raise ValueError(f"cplib.strategy: rotate={rotate!r} is not one of {list(ROTATIONS)}")
    if ulysses_degree is not None and (isinstance(ulysses_degree, bool)
                                       or not isinstance(ulysses_degree, int)
                                       or ulysses_degree < 1 or world_size % ulysses_degree):
        raise ValueError(f"cplib.strategy: ulysses_degree={ulysses_degree!r} must be a positive "
                         f"int dividing the world size {world_size}")
    if memory_limit is not None and (isinstance(memory_limit, bool)
                                     or not isinstance(memory_limit, (int, float))
                                     or not memory_limit > 0):
        raise ValueError(f"cplib.strategy: memory_limit={memory_limit!r} must be a positive "
                         "number of bytes per rank")
    return Constraints(rotate, ulysses_degree, families, data_layout, memory_limit,
                       float(margin))
