"""``_ContextParallel``: the ParallelStyle that makes one attention module
context parallel (``parallelize_module(attn, mesh, _ContextParallel(...))``),
torch's module-wrapper entry point."""

from __future__ import annotations

import functools
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from ..attention.args import window_arg
from ..flex.hook import flex_input_hook, register_flex_cp
from ..comm.handshake import agreed, handshake, register_groups
from .options import RingConfig, _cp_options, _RotateMethod, explicit_rotation, rotate_method_name
from ..attention.names import Layout, layout_of
from .shard_layout import check_layout_read
from .start_hooks import run_start_hooks
from .documents import documents_stack as _documents
from .sdpa_dispatch import CPDispatchMode, agreed_before_attention, dispatcher_enabled
from ..comm.native import check_mesh
from ..ulysses.usp_layout import UspGroups, check_degrees, usp_groups
from ..strategy.auto import AutoStrategy, parse_strategy
from .strategy_route import context_strategy

__all__ = ["_ContextParallel"]


class _ContextParallel(ParallelStyle):
    """SDPA: every SDPA call inside the module's forward runs as ring
    attention over ``mesh`` on inputs sharded with ``_context_parallel_shard``
    (head-tail when a load balancer was passed to it, which
    ``_cp_options.enable_load_balance`` records); needs
    ``_enable_context_parallel_dispatcher()``. FLEX: the module's forward
    runs as written on this rank's shards, and every flex_attention call
    inside it is computed over the whole sequence: on the flex ring under
    ``"p2p"``/``"alltoall"`` (each rank visits only the key/value blocks its
    BlockMask needs), on key and value all-gathered inside the call under
    ``set_rotate_method("allgather")`` (docs/flex.md).

    cplib's additions: ``ulysses_degree`` (USP, as ``context_parallel``'s;
    shard with ``cplib.usp_load_balancer``), ``window`` (the sliding window of
    the module's SDPA calls, as ``context_parallel``'s; ``cplib.attention_window``
    overrides it per call), and packed documents per batch through
    :func:`attention_documents`. ``strategy="auto"`` (or an
    ``AutoStrategy``) chooses the rotation of each call's shapes with cplib's
    cost model; the Ulysses degree stays the one given (the inputs are
    sharded for it). On FLEX it chooses the flex ring or the all-gather per
    sharded BlockMask. ``explain()`` (or ``cplib.explain(style)``) returns
    the choices made."""

    class AttentionType(Enum):
        FLEX = "flex_attention"
        SDPA = "scaled_dot_product_attention"

    def __init__(self, seq_dim: int, attention_type: AttentionType,
                 ulysses_degree: int = 1, *,
                 window: int | tuple[int | None, int | None] | None = None,
                 strategy: str | AutoStrategy | None = None) -> None:
        super().__init__()
        # strategy="auto": the rotation chosen per call (strategy_route.py).
        # A bad value raises when the style is applied, in the handshake every
        # rank's _apply starts with: raised here, on one rank only, it would
        # leave the others waiting there.
        self._strategy_arg = strategy
        try:
            self.strategy = parse_strategy(strategy, "_ContextParallel")
        except ValueError:
            self.strategy = None
        self._applied: list[AutoStrategy] = []  # the strategies of its modules (explain)
        if window is not None:
            window_arg(window)  # ValueError naming a bad window, at construction
        self.window = window
        self.seq_dim = seq_dim
        self.attention_type = attention_type
        # cplib's addition: USP, as context_parallel(..., ulysses_degree=U);
        # shard with _context_parallel_shard(..., cplib.usp_load_balancer(...)).
        self.ulysses_degree = ulysses_degree

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        group = check_mesh(mesh, register=False)
        run_start_hooks()  # local: cplib's integrations in place (start_hooks.py)
        register_groups(group)  # its CPU side group on NCCL, before the first handshake
        sdpa = self.attention_type == self.AttentionType.SDPA

        def check() -> None:
            parse_strategy(self._strategy_arg, "_ContextParallel")
            if sdpa:
                if self.seq_dim not in (2, -2):
                    raise NotImplementedError(
                        f"cplib: SDPA context parallelism shards (batch, heads, seq, dim) "
                        f"tensors on dim 2; got seq_dim={self.seq_dim}")
                check_degrees(dist.get_world_size(group), self.ulysses_degree)
            elif self.attention_type == self.AttentionType.FLEX:
                if self.window is not None:
                    raise NotImplementedError(
                        f"cplib: window={self.window!r} applies to SDPA attention; FLEX "
                        "attention takes its window from the block mask")
                if self.ulysses_degree != 1:
                    raise NotImplementedError(
                        f"cplib: ulysses_degree={self.ulysses_degree} applies to SDPA "
                        "attention; FLEX attention gathers keys and values instead")
            else:
                raise ValueError(f"cplib: unknown attention type {self.attention_type!r}")

        # Every rank parallelizes alike, before the first collective
        # (usp_groups) or the first forward: one error on every rank, or none.
        agreed("_ContextParallel", group.group_name, [], check)
        sides = window_arg(self.window) or [-1, -1]
        seq_dim = self.seq_dim if isinstance(self.seq_dim, int) else -99  # FLEX checks it later
        handshake(group.group_name, "_ContextParallel",
                  fields={"attention_type (1 = SDPA)": int(sdpa),
                          "seq_dim": 2 if sdpa else seq_dim,
                          "ulysses_degree": self.ulysses_degree,
                          "window is not None": int(self.window is not None),
                          "window[0]": sides[0], "window[1]": sides[1]})
        auto = context_strategy(self.strategy, group.group_name, explicit_rotation(None),
                                self.ulysses_degree if sdpa else 1)
        if auto is not None:
            self._applied.append(auto)
        if sdpa:
            groups = usp_groups(group, self.ulysses_degree)  # collective, once per mesh
            register_groups(groups.ulysses_group, groups.ring_group)  # their CPU side groups
            # The group's name, not the group: the module holds this partial
            # (and itself, through its bound forward) until the collector
            # runs, and a group held past destroy_process_group() keeps its
            # gloo workers to the interpreter's exit (test_exit_clean.py).
            module.forward = functools.partial(
                _sdpa_forward, module.forward, group.group_name, dist.get_world_size(group),
                groups, self.window, auto)
            return module
        return register_flex_cp(module, mesh, functools.partial(
            _flex_ring_selected, auto, group.group_name, dist.get_world_size(group),
            dist.get_rank(group)), _flex_layout)

    def explain(self) -> list:
        """The choices ``strategy="auto"`` made for the modules this style
        parallelized (one per distinct call, FLEX: per plan; ``print`` each
        for its table)."""
        return [c for auto in self._applied for c in auto.explain()]

    def flex_input_fn(self, module: nn.Module | None, args: Any, kwargs: Any,
                      mesh: DeviceMesh) -> Any:
        """Replaces the key and value arguments (positional or keyword, as
        ``flex_attention(query, key, value, ...)``) by their all-gathered
        full sequences."""
        return flex_input_hook(module, args, kwargs, seq_dim=self.seq_dim,
                                group_name=check_mesh(mesh).group_name)


def _flex_ring_selected(auto: AutoStrategy | None, group_name: str, world: int, rank: int,
                        args: tuple, kwargs: dict) -> bool:
    """FLEX modules' calls run on the flex ring under set_rotate_method("p2p"
    or "alltoall"), on the all-gather under "allgather" (docs/flex.md); with
    ``strategy="auto"`` the cost model chooses per plan unless a rotation is
    explicit (cplib/flex/strategy_route.py)."""
    default = _cp_options.rotate_method is not _RotateMethod.ALL_GATHER
    if auto is None:
        return default
    from ..flex.strategy_route import flex_use_ring

    return flex_use_ring(auto, explicit_rotation(None), args, kwargs, group_name, world,
                         rank, default)


def _flex_layout() -> torch.Tensor | None:
    """The original position of each row of the sequence the last
    ``_context_parallel_shard`` sharded, for FLEX calls without a BlockMask
    (None: in order)."""
    layout = _cp_options.shard_layout
    balancer = None if layout is None else layout.load_balancer
    return None if balancer is None else balancer._generate_indices(restore=False)


def _sdpa_forward(forward: Any, group_name: str, world: int, groups: UspGroups, window: Any,
                  strategy: AutoStrategy | None, *args: Any, **kwargs: Any) -> Any:
    # The documents of attention_documents, and the layout they cut (None: the
    # load balance's).
    cu_seqlens, documents_layout = _documents[-1] if _documents else (None, None)

    # A rotation set explicitly after parallelize_module wins over the
    # strategy's choice too (it is read per call, as the rotation itself is).
    explicit = explicit_rotation(None) if strategy is not None and strategy.rotate is None else None
    call_strategy = None if explicit is not None else strategy

    def check() -> RingConfig:
        if not dispatcher_enabled():
            raise RuntimeError(
                "cplib: this module was parallelized with _ContextParallel but the context "
                "parallel dispatcher is off; call cplib._enable_context_parallel_dispatcher() "
                "first")
        if documents_layout == Layout.PLACEMENT and groups.ulysses_degree > 1:
            raise NotImplementedError(
                f"cplib: attention_documents(placement=True) with ulysses_degree="
                f"{groups.ulysses_degree}: the placement is a ring layout")
        layout = documents_layout or layout_of("_ContextParallel",
                                               _cp_options.enable_load_balance)
        check_layout_read(_cp_options.shard_layout, read=layout, cu_seqlens=cu_seqlens,
                          world_size=world, ulysses_degree=groups.ulysses_degree)
        return RingConfig(groups.ring_group or group_name, world, layout,
                          rotate_method_name(_cp_options.rotate_method), groups.ulysses_degree,
                          groups.ulysses_group,
                          seq_len=None if cu_seqlens is None else int(cu_seqlens[-1]),
                          cu_seqlens=cu_seqlens, window=window, strategy=call_strategy)

    # An error here meets the handshake the other ranks' SDPA calls start with.
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    config = agreed_before_attention("_ContextParallel", groups.ring_group or group_name,
                                     groups.ulysses_group, tensors, check)
    with CPDispatchMode(config):
        return forward(*args, **kwargs)
