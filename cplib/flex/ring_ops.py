"""Fake kernels and Python entry points of the flex ring's communication ops
(``csrc/torch/flex/ring_exchange.cpp``): the handshake that opens a ring
call and the exchange of one step.

Each exchange takes the previous one's token as ``after`` and the chain
ends in ``flex_ring_end`` (a copy of a tensor the caller returns): the
exchanges of a compiled graph stay in program order on every rank, and none
is dropped on a rank that reads none of their outputs (one that receives
nothing at a step still joins that step's collective). The ops are not
marked as side-effectful on purpose: AOT's partitioner keeps such ops in
both the forward and the backward graph, which would run the forward's
exchanges again in the backward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..comm.native import ops, reject_real_in_fake

__all__ = ["ring_begin", "ring_shift", "ring_end", "ring_bytes_received"]


@torch.library.register_fake("cplib_c::flex_ring_begin")
def _begin_fake(q, k, v, names, values, group_name):
    reject_real_in_fake("flex_ring_begin", q, k, v)
    return q.new_empty((0,))


@torch.library.register_fake("cplib_c::flex_ring_shift")
def _shift_fake(send, after, dst, recv_numel, src, group_name):
    reject_real_in_fake("flex_ring_shift", send, after)
    return send.new_empty((recv_numel,)), send.new_empty((0,))


@torch.library.register_fake("cplib_c::flex_ring_end")
def _end_fake(x, after):
    reject_real_in_fake("flex_ring_end", x, after)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _end_backward(ctx, grad):
    return grad, None


# ring_end is the identity on ``x`` (the copy of a differentiable input
# orders a collective after the call's handshake: cp_mode.py).
torch.library.register_autograd("cplib_c::flex_ring_end", _end_backward)

# `ops` makes each op's wrapper on first use, a mutation that torch.compile
# refuses inside the ring's autograd.Function: make them now.
for _name in ("flex_ring_begin", "flex_ring_shift", "flex_ring_end", "merge_partial_"):
    getattr(ops, _name)


def ring_begin(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fields: dict[str, int],
               group_name: str) -> torch.Tensor:
    """The ring call's handshake (``fields``: named integers every rank must
    agree on); returns the token the first exchange takes."""
    return ops.flex_ring_begin(q, k, v, list(fields), [int(x) for x in fields.values()],
                               group_name)


def ring_shift(send: torch.Tensor, after: torch.Tensor, dst: int, recv_numel: int, src: int,
               group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Sends the flat ``send`` to rank ``dst``; returns the ``recv_numel``
    elements rank ``src`` sent (an empty tensor when 0) and the token the
    next exchange takes as ``after``. Every rank of the group calls it at the
    same step."""
    return ops.flex_ring_shift(send, after, dst, recv_numel, src, group_name)


def ring_end(x: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` after the exchange that produced ``after`` (the end of
    a chain of exchanges: see the module docstring)."""
    return ops.flex_ring_end(x, after)


def ring_bytes_received(reset: bool = False) -> int:
    """Bytes this process has received in flex ring exchanges since the last
    reset (K/V blocks and returned dK/dV; a debug counter for tests and the
    benchmark)."""
    return int(ops.flex_ring_debug_bytes(reset))


def pack(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``parts`` flattened into one contiguous buffer (one copy)."""
    return torch.cat([p.reshape(-1) for p in parts])
