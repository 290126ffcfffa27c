"""The collectives the native layer calls (``cplib_c::c10d_*``, schemas in
csrc/torch/comm/collectives.cpp, registered by native.py): the stable ABI
has no process-group API,
and from torch 2.13 on torch's functional collectives take their group as
``Any``, which the stable dispatcher call cannot pass. Each one makes the
group's own call and registers its work with torch's work registry, so that
``_c10d_functional::wait_tensor`` (which the native layer calls) waits for
it: what the functional collectives do, without their Python autograd
wrappers. Torch's threaded test group, whose collectives are Python, takes
the functional ops."""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

__all__ = ["IMPLEMENTATIONS"]

_resolve = dist.distributed_c10d._resolve_process_group
_register_work = torch._C._distributed_c10d._register_work
_ALL_TO_ALL_OPTIONS = dist.AllToAllOptions()

# The torch calls that move bytes, looked up at each call (the tests count
# the bytes that cross the group by wrapping them: tests/support/wire_count.py).
_functional = torch.ops._c10d_functional


def _alltoall_base(pg: dist.ProcessGroup, out: torch.Tensor, input: torch.Tensor,
                   output_split_sizes: list[int], input_split_sizes: list[int]):
    return pg.alltoall_base(out, input, output_split_sizes, input_split_sizes,
                            _ALL_TO_ALL_OPTIONS)


_batch_isend_irecv = dist.batch_isend_irecv


def _runs_on_gloo(group_name: str, device: torch.device) -> bool:
    try:
        backend = _resolve(group_name)._get_backend(device)
    except Exception:  # no backend for this device: not gloo
        return False
    return isinstance(backend, getattr(dist, "ProcessGroupGloo", ()))


def _all_gather(input: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    if _runs_on_gloo(group_name, input.device):
        # gloo's all-gather (allgather_coalesced, behind the functional op)
        # corrupts the heap when two are in flight at once (two K/V gathers:
        # "malloc(): unaligned tcache chunk detected" within a few hundred
        # calls on torch 2.13, reproduced without cplib); its all-to-all does
        # not. The same exchange as an all-to-all: every rank sends its whole
        # input to every rank, received rank-major as all_gather would.
        rows = input.shape[0]
        splits = [rows] * group_size
        # One cat: repeat() costs a dozen ATen calls on the host.
        repeated = torch.cat([input] * group_size)
        return _all_to_all(repeated, splits, splits, group_name)
    return _functional.all_gather_into_tensor(input, group_size, group_name)


def _reduce_scatter_sum(input: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    return _functional.reduce_scatter_tensor(input, "sum", group_size, group_name)


def _all_to_all(input: torch.Tensor, output_split_sizes: list[int],
                input_split_sizes: list[int], group_name: str) -> torch.Tensor:
    pg = _resolve(group_name)
    if type(pg) is not dist.ProcessGroup:  # torch's threaded group: its own Python collectives
        return _functional.all_to_all_single(input, output_split_sizes, input_split_sizes,
                                             group_name)
    # The functional op's call, without its Python autograd wrapper (about 35
    # us of host time per call).
    out = input.new_empty((sum(output_split_sizes), *input.shape[1:]))
    _register_work(out, _alltoall_base(pg, out, input, output_split_sizes, input_split_sizes))
    return out


def _sends_point_to_point(pg: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether neighbour exchanges on ``pg`` are point-to-point calls: where
    its backend batches them into one launch (NCCL), so that an exchange
    involves its two peers only; a split all-to-all there posts a send and a
    receive to every peer, empty ones included. On gloo a send/recv ring
    costs about 1.8 times the host CPU of the same exchanges as all-to-alls
    (gloo's transport thread; docs/comm.md), and torch's threaded group has
    no send/recv: both take the all-to-all."""
    try:
        return type(pg) is dist.ProcessGroup and pg._get_backend(device).supports_coalescing
    except Exception:  # no backend for this device
        return False


# The groups whose first neighbour exchange this process made.
_exchanged: weakref.WeakSet[dist.ProcessGroup] = weakref.WeakSet()


def _send_recv(input: torch.Tensor, dst: int, recv_numel: int, src: int,
               group_name: str) -> torch.Tensor:
    """``input`` to rank ``dst`` and ``recv_numel`` elements from rank
    ``src`` (csrc/torch/comm/collectives.h: send_recv): one send and one
    receive, batched, where the group sends point to point."""
    pg = _resolve(group_name)
    point_to_point = _sends_point_to_point(pg, input.device)
    if not point_to_point or pg not in _exchanged:
        if point_to_point:
            # NCCL creates a group's communicator with every rank: a group's
            # first exchange is a collective (every rank calls this at the
            # same point, with nothing to exchange too).
            _exchanged.add(pg)
        ins, outs = [0] * pg.size(), [0] * pg.size()
        ins[dst], outs[src] = input.numel(), recv_numel
        return _all_to_all(input, outs, ins, group_name)
    out = input.new_empty((recv_numel,))
    ops = [dist.P2POp(dist.isend, input, group=pg, group_peer=dst)] if input.numel() else []
    if recv_numel:
        ops.append(dist.P2POp(dist.irecv, out, group=pg, group_peer=src))
    for work in _batch_isend_irecv(ops) if ops else []:
        _register_work(out, work)  # wait_tensor(out) waits for the send too
    return out


# The ops' Python implementations, by op name.
IMPLEMENTATIONS = {"c10d_all_gather": _all_gather, "c10d_reduce_scatter_sum": _reduce_scatter_sum,
                   "c10d_all_to_all": _all_to_all, "c10d_send_recv": _send_recv}
