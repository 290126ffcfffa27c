"""The sequence layout a hybrid layer runs under (cplib/clients/hf_hybrid.py):
a ``cplib.context_parallel`` region's, or on the module path
(``parallelize_module(..., _ContextParallel(...))``, torchtitan) the one the
last ``_context_parallel_shard`` recorded, as cplib's losses read it
(cplib/frontend/sequence.py).

On the module path there is no region to say that a layer runs under context
parallelism, so its input's length does: a layer whose input holds this
rank's shard of the recorded sequence (and not the whole of it) runs under
that layout; any other length runs as in one process. Every decision reads
the record and shapes alone, the same on every rank.
"""

from __future__ import annotations

from ..comm.native import check_mesh
from ..frontend.options import _cp_options
from ..frontend.shard_layout import HEAD_TAIL, SEQUENTIAL
from ..hybrid.layout import SequenceLayout
from ..frontend.sequence import SequenceShards, active_handle

__all__ = ["layout_in_effect"]


def layout_in_effect(local_len: int, what: str) -> SequenceLayout | None:
    """The layout the layer ``what``, whose input holds ``local_len``
    positions, runs under; None outside context parallelism."""
    handle = active_handle()
    if handle is not None:
        return SequenceLayout.of_context(handle, local_len, what)
    record = _cp_options.shard_layout
    if record is None or record.mesh is None or len(record.seq_lens) != 1:
        return None
    shards = SequenceShards(record.mesh, record.load_balancer, record.seq_lens[0], "")
    n = record.mesh.size()
    if n == 1 or local_len == shards.seq_len or local_len != shards.local_len():
        return None
    if record.kind not in (SEQUENTIAL, HEAD_TAIL) or record.ulysses_degree != 1:
        raise NotImplementedError(
            f"cplib: {what} on inputs that _context_parallel_shard cut with {record.balancer}: "
            "recurrent and convolution layers run on sequential or head-tail shards only; "
            "shard with _HeadTailLoadBalancer or without a load balancer")
    layout = SequenceLayout(check_mesh(record.mesh).group_name, n, record.mesh.get_local_rank(),
                            shards.seq_len, record.kind == HEAD_TAIL)
    if layout.lengths() != shards.lengths():
        raise NotImplementedError(
            f"cplib: {what} on inputs that _context_parallel_shard cut with {record.balancer} "
            f"into shards of {shards.lengths()} positions, where cplib's recurrent layers "
            f"read {layout.lengths()}: shard with cplib's load balancers")
    return layout
