"""``context_parallel``: shard the buffers in place, route SDPA to the ring
op, and undo both on every exit."""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Sequence
from typing import Any
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.overrides import _get_current_function_mode_stack

from ..attention.names import Layout
from ..diffusers.plans import applied_cp_plans
from ..comm.handshake import agreed, handshake, register_groups, values_hash
from ..ring.load_balancer import _LoadBalancer, shard_lengths
from .context_plan import ContextPlan, plan_context
from .options import (RingConfig, _cp_options, _RotateMethod, explicit_rotation,
                      rotate_method_name)
from .sdpa_dispatch import CPDispatchMode
from ..comm.native import check_mesh
from .sharding import keep_shards_for_backward, shard_tensor
from .start_hooks import run_start_hooks
from .unshard import unshard
from ..ulysses.usp_layout import ulysses_layout, usp_groups
from ..strategy.auto import AutoStrategy, parse_strategy
from .strategy_route import strategy_entry

__all__ = ["context_parallel", "ContextParallelHandle"]


@dataclass(frozen=True)
class ContextParallelHandle:
    """What ``with context_parallel(...) as cp`` binds: the resolved layout, so
    that outputs can be unsharded without consulting global options."""

    mesh: DeviceMesh
    config: RingConfig
    load_balancer: _LoadBalancer | None
    strategy: AutoStrategy | None = None  # strategy="auto": cplib.explain(cp) shows its choices
    # What places the shards (_layout_key): a nested region must place them alike.
    layout_key: tuple = ()

    def unshard(self, tensors: Sequence[torch.Tensor],
                seq_dims: Sequence[int]) -> list[torch.Tensor]:
        """Full sequences from this context's shards, differentiable (see
        ``cplib.unshard``)."""
        return unshard(self.mesh, list(tensors), list(seq_dims), self.load_balancer)


def _agree_on_call(group_name: str, buffers: list, seq_dims: list, no_restore: list,
                   modules: int, rotate: _RotateMethod, ulysses_degree: int, load_balance,
                   balanced: bool, documents: torch.Tensor | None,
                   window: list[int] | None) -> None:
    """The handshake of the entry: every rank must shard the same buffers the
    same way (a buffer that differs is named, with the ranks and values)."""
    fields = {f"buffer_seq_dims[{i}]": d % b.ndim
              for i, (b, d) in enumerate(zip(buffers, seq_dims))}
    fields["number of no_restore_buffers"] = len(no_restore)
    fields["number of modules"] = modules
    fields["rotate_method (1 = alltoall, 2 = allgather, 3 = p2p)"] = rotate.value
    fields["ulysses_degree"] = ulysses_degree
    fields["load_balance (-1 = None, 0 = False, 1 = True, 2 = 'per_document', "
           "3 = 'placement')"] = (-1 if load_balance is None else int(load_balance)
                                  if not isinstance(load_balance, str)
                                  else 3 if load_balance == Layout.PLACEMENT else 2)
    fields["load balancing in effect"] = int(balanced)
    fields["documents (hash of cu_seqlens)"] = (
        -1 if documents is None else values_hash(documents.tolist()))
    for i, side in enumerate(window or []):
        fields[f"window[{i}]"] = side
    handshake(group_name, "context_parallel", {f"buffer {i}": b for i, b in enumerate(buffers)},
              fields)


def _enclosing_regions() -> list[CPDispatchMode]:
    return [mode for mode in _get_current_function_mode_stack()
            if isinstance(mode, CPDispatchMode) and mode.handle is not None]


def _explicit_seq_len(world_size: int, plan: ContextPlan) -> int | None:
    """The global length the attention calls are given (None: they infer it
    from equal shards). The ring infers S from equal shards of two equal
    head-tail chunks each; uneven shards, or chunks (S not a multiple of 2 x
    the ring's size: equal shards of an odd length, or USP's ring shards),
    or documents need it."""
    seq_len = plan.seq_len
    uneven = seq_len is not None and shard_lengths(seq_len, world_size, plan.balancer) is not None
    uneven = uneven or (plan.balanced and seq_len is not None
                        and seq_len % (2 * plan.ring_degree) != 0)
    return seq_len if plan.one_length and (uneven or plan.documents is not None) else None


def _layout_key(group_name: str, world_size: int, plan: ContextPlan) -> tuple:
    """What decides where every row of an attention call's inputs sits:
    two regions with one key read every shard alike."""
    docs = None if plan.documents is None else values_hash(plan.documents.tolist())
    return (group_name, world_size, plan.ring_degree, str(plan.layout),
            _explicit_seq_len(world_size, plan), docs)


def _check_nesting(enclosing: list[CPDispatchMode], group_name: str, world_size: int,
                   plan: ContextPlan) -> ContextPlan:
    """``plan``, unless it is a region inside another that places the shards
    otherwise: it runs every attention call in its own layout, the calls on
    the outer region's shards included (refused on every rank: the keys are
    local and equal). ``plan_context`` refused every buffer the outer
    regions hold sharded."""
    key = _layout_key(group_name, world_size, plan)
    if enclosing and enclosing[-1].handle.layout_key != key:
        outer = enclosing[-1].handle.layout_key
        raise NotImplementedError(
            f"cplib.context_parallel: a region nested in another that shards in another "
            f"layout (outer: group {outer[0]}, {outer[3]}, ulysses_degree "
            f"{outer[1] // outer[2]}, length {outer[4]}; inner: group {key[0]}, {key[3]}, "
            f"ulysses_degree {key[1] // key[2]}, length {key[4]}; or other documents): "
            "attention inside it on the outer region's shards would read them in the inner "
            "layout; nest only regions of the same mesh and load_balance, or exit the outer "
            "region first")
    return plan


def _ring_config(groups, group_name: str, world_size: int, plan: ContextPlan, window: Any,
                 strategy: Any) -> RingConfig:
    """The configuration of the attention calls inside a context."""
    return RingConfig(groups.ring_group or group_name, world_size, plan.layout,
                      rotate_method_name(plan.rotate), world_size // plan.ring_degree,
                      groups.ulysses_group, seq_len=_explicit_seq_len(world_size, plan),
                      cu_seqlens=plan.documents, window=window, strategy=strategy)


@contextlib.contextmanager
def context_parallel(
    mesh: DeviceMesh,
    *,
    buffers: Sequence[torch.Tensor] | None = None,
    buffer_seq_dims: Sequence[int] | None = None,
    no_restore_buffers: set[torch.Tensor] | None = None,
    rotate_method: str | _RotateMethod | None = None,
    load_balance: bool | str | None = None,
    ulysses_degree: int = 1,
    cu_seqlens: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    window: int | tuple[int | None, int | None] | None = None,
    modules: Sequence[torch.nn.Module] | None = None,
    strategy: str | AutoStrategy | None = None,
) -> Generator[ContextParallelHandle, None, None]:
    """Context parallelism for the code inside the ``with`` block.

    Same arguments and behaviour as torch's ``context_parallel``:

    * ``buffers`` (inputs, labels, positions: anything indexed by the
      sequence) are sharded in place along ``buffer_seq_dims``: head-tail
      when load balancing is on and the lengths divide by ``2 * world_size``,
      sequential otherwise;
    * every ``scaled_dot_product_attention`` call inside the block runs as
      ring attention over ``mesh`` (a 1-D mesh; slice ``mesh["cp"]`` from a
      larger one);
    * on exit, exceptions included, SDPA is plain again and the buffers are
      restored exactly (shape, strides and bytes), except those in
      ``no_restore_buffers``.

    cplib's additions: ``rotate_method`` (``"p2p"``, ``"alltoall"``,
    ``"allgather"``) and ``load_balance`` override ``_cp_options`` for this
    context only (``load_balance=True`` gives head-tail shards for any
    length, within one token per chunk of each other, where torch's default
    falls back to sequential), and the context yields a
    :class:`ContextParallelHandle` whose ``unshard`` knows the layout.
    ``strategy="auto"`` (or ``cplib.AutoStrategy(...)``) lets cplib's cost
    model choose what the explicit settings leave open (docs/strategy.md).

    ``ulysses_degree=U`` (USP, cplib/ulysses/usp_layout.py) splits the N ranks into
    N/U ring positions x U Ulysses ranks: every SDPA call runs Ulysses
    (all-to-all over heads) within groups of U consecutive ranks and ring
    attention across them; U = N is pure Ulysses, U = 1 (default) the ring.
    U must divide N and the heads of every attention call (ValueError).
    With load balancing the layout is head-tail over the N/U ring positions,
    then each ring shard is cut in U pieces (``cplib.usp_load_balancer``).
    Documents, windows, per-document balancing and any length combine with
    USP as with the ring: the ring runs on the ring shards the Ulysses
    exchange assembles.

    Any length S >= world size shards without padding. Packed documents:
    ``cu_seqlens`` (``[0, s1, ..., S]``, global, unsharded) or
    ``position_ids`` (``(S,)`` or ``(B, S)``, restarting at 0 at each
    document, as Hugging Face packs them; the full tensor, read before
    sharding) make every SDPA call inside attend within documents only.
    ``window`` is the default sliding window of those calls
    (``cplib.attention_window`` sets it per call). With documents,
    ``load_balance="per_document"`` cuts every document head-tail across
    the ranks (``AnyLengthPerDocumentLoadBalancer``), so each rank holds a
    share of every document; ``load_balance="placement"``
    (``DocumentPlacementLoadBalancer``) keeps documents whole on one rank
    where the balance allows, so that only documents that span ranks move.

    Buffers may have different lengths (a diffusion transformer's text and
    image tokens): each is cut on its own, and non-causal attention accepts
    ranks whose joint shards differ in length (33 text tokens and 256 image
    tokens over 2 ranks: 145 and 144 rows). Entering compares the buffers'
    shapes across ranks (one small all-gather): buffers that differ raise
    the same ValueError on every rank. ``modules`` (diffusers models, or any
    module with a ``_cp_plan``) get their plan applied through diffusers'
    hooks for the duration of the context (cplib/diffusers/plans.py): the model
    splits and gathers the sequence inside its own forward, in sequential
    any-length shards, and the hooks are gone on exit. A backward() after
    the block exits gets the right gradients, unless it would recompute a
    checkpointed block's attention: that raises NotImplementedError (keep
    such a backward inside the block). A region nested in another must shard
    in the same layout, or raises NotImplementedError on entry.
    """
    group = check_mesh(mesh, register=False)
    run_start_hooks()  # local: cplib's integrations in place (start_hooks.py)
    # The handshake's CPU side group on NCCL (a collective, the first time
    # only) before the first handshake, which then runs on it in host memory
    # (and no warning says the group has none).
    register_groups(group)
    buffers = [] if buffers is None else list(buffers)
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    # 1. Every check before the handshake, whose all-gather comes before any
    # other collective (usp_groups); an error on one rank raises on all.
    regions = _enclosing_regions()

    def plan(u: int = ulysses_degree, rotate=rotate_method, balance=load_balance) -> ContextPlan:
        return _check_nesting(regions, group.group_name, world_size, plan_context(
            buffers, world_size, buffer_seq_dims, no_restore_buffers, rotate, balance, u,
            cu_seqlens, position_ids, window, modules, [b for m in regions for b in m.buffers]))

    modules = [] if modules is None else list(modules)
    # 2. Every rank agrees on the plan and the call; strategy="auto" may choose more.
    auto, planned = agreed("context_parallel", group.group_name, buffers,
                           lambda: (parse_strategy(strategy, "context_parallel"), plan()))
    auto, per_call, planned = strategy_entry(auto, planned, plan, group.group_name,
                                             mesh.device_type, explicit_rotation(rotate_method),
                                             ulysses_degree)
    ulysses_degree = world_size // planned.ring_degree
    _agree_on_call(group.group_name, buffers, planned.seq_dims, planned.no_restore, len(modules),
                   planned.rotate, ulysses_degree, load_balance, planned.balanced,
                   planned.documents, planned.window)

    # 3. The shards, and the configuration of the attention calls inside.
    groups = usp_groups(group, ulysses_degree)  # collective the first time only
    # Their side groups too (collective the first time only).
    register_groups(groups.ulysses_group, groups.ring_group)
    balancer = planned.balancer
    with torch.no_grad():
        shards = [shard_tensor(b, d, rank, world_size, planned.indices,
                               shard_lengths(b.shape[d], world_size, balancer))
                  for b, d in zip(buffers, planned.seq_dims)]
    # Keep the original storage and geometry: restoring points each buffer
    # back at them, so the bytes, shape and strides are exactly the old ones.
    saved = [None if any(b is t for t in planned.no_restore)
             else (b.untyped_storage(), b.storage_offset(), b.size(), b.stride())
             for b in buffers]
    config = _ring_config(groups, group.group_name, world_size, planned, window, per_call)
    # 4. Shards in, attention dispatched inside the block; buffers restored on exit.
    old_balance = _cp_options.enable_load_balance
    swapped = 0
    try:
        with torch.no_grad():
            for b, s in zip(buffers, shards):
                b.set_(s)
                swapped += 1
        _cp_options.enable_load_balance = planned.balanced  # as torch does, for code that reads it
        handle = ContextParallelHandle(mesh, config, balancer, auto,
                                       _layout_key(group.group_name, world_size, planned))
        with keep_shards_for_backward(shards), CPDispatchMode(config, handle, tuple(buffers)), \
                ulysses_layout(ulysses_degree), applied_cp_plans(mesh, modules):
            yield handle
    finally:
        _cp_options.enable_load_balance = old_balance
        with torch.no_grad():
            for b, geometry in zip(buffers[:swapped], saved[:swapped]):
                if geometry is not None:
                    b.set_(*geometry)
