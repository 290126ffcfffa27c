"""``_ContextParallel``: the ParallelStyle that makes one attention module
context parallel (``parallelize_module(attn, mesh, _ContextParallel(...))``),
torch's module-wrapper entry point."""

from __future__ import annotations

import functools
from enum import Enum
from typing import Any

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from ._flex_hook import _flex_input_hook, _register_flex_input_hook
from ._options import RingConfig, _cp_options, rotate_method_name
from ._sdpa_dispatch import CPDispatchMode, dispatcher_enabled
from ._native import check_mesh
from ._usp import UspGroups, usp_groups

__all__ = ["_ContextParallel"]


class _ContextParallel(ParallelStyle):
    """SDPA: every SDPA call inside the module's forward runs as ring
    attention over ``mesh`` on inputs sharded with ``_context_parallel_shard``
    (head-tail when a load balancer was passed to it, which
    ``_cp_options.enable_load_balance`` records); needs
    ``_enable_context_parallel_dispatcher()``. FLEX: the module's key and
    value arguments are all-gathered along ``seq_dim`` before its forward."""

    class AttentionType(Enum):
        FLEX = "flex_attention"
        SDPA = "scaled_dot_product_attention"

    def __init__(self, seq_dim: int, attention_type: AttentionType,
                 ulysses_degree: int = 1) -> None:
        super().__init__()
        self.seq_dim = seq_dim
        self.attention_type = attention_type
        # cplib's addition: USP, as context_parallel(..., ulysses_degree=U);
        # shard with _context_parallel_shard(..., cplib.usp_load_balancer(...)).
        self.ulysses_degree = ulysses_degree

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        group = check_mesh(mesh)
        if self.attention_type == self.AttentionType.SDPA:
            if self.seq_dim not in (2, -2):
                raise NotImplementedError(
                    f"cplib: SDPA context parallelism shards (batch, heads, seq, dim) tensors "
                    f"on dim 2; got seq_dim={self.seq_dim}"
                )
            groups = usp_groups(group, self.ulysses_degree)  # collective, once per mesh
            module.forward = functools.partial(_sdpa_forward, module.forward, group, groups)
            return module
        if self.attention_type == self.AttentionType.FLEX:
            if self.ulysses_degree != 1:
                raise NotImplementedError(
                    f"cplib: ulysses_degree={self.ulysses_degree} applies to SDPA attention; "
                    "FLEX attention gathers keys and values instead"
                )
            return _register_flex_input_hook(module, mesh, self.seq_dim)
        raise ValueError(f"cplib: unknown attention type {self.attention_type!r}")

    def flex_input_fn(self, module: nn.Module | None, args: Any, kwargs: Any,
                      mesh: DeviceMesh) -> Any:
        """Replaces the key and value arguments (positional or keyword, as
        ``flex_attention(query, key, value, ...)``) by their all-gathered
        full sequences."""
        return _flex_input_hook(module, args, kwargs, seq_dim=self.seq_dim,
                                group_name=check_mesh(mesh).group_name)


def _sdpa_forward(forward: Any, group: dist.ProcessGroup, groups: UspGroups, *args: Any,
                  **kwargs: Any) -> Any:
    if not dispatcher_enabled():
        raise RuntimeError(
            "cplib: this module was parallelized with _ContextParallel but the context "
            "parallel dispatcher is off; call cplib._enable_context_parallel_dispatcher() first"
        )
    config = RingConfig(groups.ring_group or group.group_name, dist.get_world_size(group),
                        _cp_options.enable_load_balance,
                        rotate_method_name(_cp_options.rotate_method), groups.ulysses_degree,
                        groups.ulysses_group)
    with CPDispatchMode(config):
        return forward(*args, **kwargs)
