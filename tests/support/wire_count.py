"""The bytes that really crossed the process group, counted where cplib hands
its collectives to torch: the calls the ``cplib_c::c10d_*`` ops make
(``cplib/comm/collectives.py``: a group's ``alltoall_base``,
``dist.batch_isend_irecv`` and torch's functional collectives; every
collective of cplib's native layer goes through them, docs/comm.md). The
count reads the collectives' own arguments (the tensor, its split sizes, the
point-to-point ops), never a plan of cplib's, so a test can hold a
prediction made from the plan against it.

Only floating-point payloads count (K/V blocks, gradients, outputs): the
handshakes and the plans' agreements exchange integers. Rows a rank sends
to itself do not cross the group and do not count.

    with counting_wire() as wire:
        ...                      # cplib ops on this rank
    wire.sent, wire.received     # bytes this rank sent to / received from others
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from cplib.comm import collectives

__all__ = ["WireCount", "counting_wire"]


class WireCount:
    """Bytes this rank sent to and received from the other ranks."""

    def __init__(self) -> None:
        self.sent = 0
        self.received = 0
        self._lock = threading.Lock()

    def add(self, sent: int, received: int) -> None:
        with self._lock:
            self.sent += sent
            self.received += received

    def take(self) -> tuple[int, int]:
        """(sent, received) since the last take, and starts again from 0."""
        with self._lock:
            out = (self.sent, self.received)
            self.sent = self.received = 0
            return out


def _rank(group_name: str) -> int:
    return dist.distributed_c10d._resolve_process_group(group_name).rank()


def _count_all_to_all(count: WireCount, input: torch.Tensor, output_split_sizes,
                      input_split_sizes, n: int, me: int) -> None:
    if input.is_floating_point():
        even = [input.shape[0] // n] * n
        outs, ins = list(output_split_sizes or even), list(input_split_sizes or even)
        row = math.prod(input.shape[1:]) * input.element_size()
        count.add(sum(x for j, x in enumerate(ins) if j != me) * row,
                  sum(x for j, x in enumerate(outs) if j != me) * row)


class _CountingCollectives:
    """``torch.ops._c10d_functional`` with its payload collectives counted."""

    def __init__(self, real, count: WireCount) -> None:
        self._real, self._count = real, count

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def all_to_all_single(self, input: torch.Tensor, output_split_sizes: Sequence[int] | None,
                          input_split_sizes: Sequence[int] | None, group_name: str):
        _count_all_to_all(self._count, input, output_split_sizes, input_split_sizes,
                          dist.distributed_c10d._get_group_size_by_name(group_name),
                          _rank(group_name))
        return self._real.all_to_all_single(input, output_split_sizes, input_split_sizes,
                                            group_name)

    def all_gather_into_tensor(self, input: torch.Tensor, group_size: int, group_name: str):
        if input.is_floating_point():  # our rows reach every other rank, theirs reach us
            nbytes = input.numel() * input.element_size()
            self._count.add((group_size - 1) * nbytes, (group_size - 1) * nbytes)
        return self._real.all_gather_into_tensor(input, group_size, group_name)

    def reduce_scatter_tensor(self, input: torch.Tensor, op: str, group_size: int,
                              group_name: str):
        if input.is_floating_point():  # the other ranks' chunks leave, ours arrive from each
            chunk = input.numel() * input.element_size() // group_size
            self._count.add((group_size - 1) * chunk, (group_size - 1) * chunk)
        return self._real.reduce_scatter_tensor(input, op, group_size, group_name)


@contextlib.contextmanager
def counting_wire() -> Iterator[WireCount]:
    """Counts, on this rank, the payload bytes of every collective cplib's
    native layer runs inside the block (restored on exit)."""
    count = WireCount()
    real = (collectives._functional, collectives._alltoall_base, collectives._batch_isend_irecv)

    def alltoall_base(pg, out, input, output_split_sizes, input_split_sizes):
        _count_all_to_all(count, input, output_split_sizes, input_split_sizes, pg.size(),
                          pg.rank())
        return real[1](pg, out, input, output_split_sizes, input_split_sizes)

    def batch_isend_irecv(ops):
        for op in ops:  # every peer is another rank
            if op.tensor.is_floating_point():
                nbytes = op.tensor.numel() * op.tensor.element_size()
                sent = op.op is dist.isend
                count.add(nbytes if sent else 0, 0 if sent else nbytes)
        return real[2](ops)

    collectives._functional = _CountingCollectives(real[0], count)
    collectives._alltoall_base = alltoall_base
    collectives._batch_isend_irecv = batch_isend_irecv
    try:
        yield count
    finally:
        collectives._functional, collectives._alltoall_base, collectives._batch_isend_irecv = real
