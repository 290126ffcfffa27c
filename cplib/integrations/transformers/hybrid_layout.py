"""The sequence layout a hybrid layer runs under (hybrid.py): a
``cplib.context_parallel`` region's, else the module-path scope's (a
transformers model's forward given shards of ``_context_parallel_shard``:
cplib/frontend/sequence.py), else the one its own input was cut in (a model
of the user's own handed a shard straight from ``_context_parallel_shard``).
Nothing else: a layer given a tensor of some length outside those scopes
runs as in one process. Every decision reads the scope and shapes alone, the
same on every rank.
"""

from __future__ import annotations

from typing import Any

from ...comm.native import check_mesh
from ...frontend.sequence import (SequenceShards, active_handle, layout_in_scope, shards_of,
                                  traced_on_the_module_path)
from ...hybrid.layout import LAYOUTS_READ_IN_ORDER, SequenceLayout

__all__ = ["layout_in_effect"]


def layout_in_effect(x: Any, what: str) -> SequenceLayout | None:
    """The layout the layer ``what``, whose input ``x`` is (batch, seq, ...),
    runs under; None outside context parallelism."""
    handle = active_handle()
    if handle is not None:
        return SequenceLayout.of_context(handle, x.shape[1], what)
    traced_on_the_module_path(what)
    shards = layout_in_scope() or shards_of(x)
    if shards is None or shards.mesh.size() == 1:
        return None
    return _layout_of(shards, x.shape[1], what)


def _layout_of(shards: SequenceShards, local_len: int, what: str) -> SequenceLayout:
    kind = shards.layout
    if kind.kind not in LAYOUTS_READ_IN_ORDER or kind.ulysses_degree != 1:
        raise NotImplementedError(
            f"cplib: {what} on {shards.source}, cut with {kind.balancer}: recurrent and "
            "convolution layers run on sequential or head-tail shards only; shard with "
            "_HeadTailLoadBalancer or without a load balancer")
    mesh = shards.mesh
    layout = SequenceLayout(check_mesh(mesh).group_name, mesh.size(), mesh.get_local_rank(),
                            shards.seq_len, kind.kind)
    if layout.lengths() != shards.lengths():
        raise NotImplementedError(
            f"cplib: {what} on {shards.source}, cut into shards of {shards.lengths()} "
            f"positions, where cplib's recurrent layers read {layout.lengths()}: shard with "
            "cplib's load balancers")
    if local_len != layout.local_len:
        raise ValueError(
            f"cplib: {what} got {local_len} positions on rank {layout.rank}, but its shard of "
            f"{shards.source} holds {layout.local_len}: shard the layer's input like the "
            "model's inputs")
    return layout
