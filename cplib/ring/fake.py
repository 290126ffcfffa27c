"""Fake kernels of ``cplib_c::ring_sdpa`` and its backward ops: shapes for
tracing and compile, the argument checks, and on plain meta tensors the
handshake (a rank on meta tensors beside ranks on real ones raises with
them)."""

from __future__ import annotations

import torch

from ..attention.args import acc_dtype, check_sinks
from ..comm.handshake import agreed, can_handshake, tracing
from ..comm.native import ops, reject_real_in_fake
from .call import ARGS, RingCall
from .check import check_call


def _meta_call(group_name, tensors) -> bool:
    """Plain meta tensors (not fake, no trace) on a real group of more than
    one rank: the call handshakes like a real one, so that a rank on meta
    tensors beside ranks on real ones raises with them (under FakeTensorMode
    or torch.compile nothing communicates)."""
    return (isinstance(tensors[0], torch.Tensor) and tensors[0].device.type == "meta"
            and not tracing(tensors) and isinstance(group_name, str)
            and can_handshake(group_name, tensors, meta_joins=True))


def _fake_checks(op: str, group_name, tensors, describe, checks) -> None:
    """``checks()``, and on plain meta tensors the handshake (``describe()``;
    a failing check travels in it, see _meta_call)."""
    if not _meta_call(group_name, tensors):
        checks()
        return
    agreed(op, group_name, tensors, checks, meta_joins=True)
    describe()


def _call_of(args: tuple) -> RingCall:
    """The record of the ops' shared arguments (``args`` after the tensors;
    missing trailing ones take their defaults)."""
    return RingCall(*args[:ARGS])


def _describe(op: str, tensors: list, call: RingCall):
    return lambda: ops.ring_describe_call(op, tensors, *call.op_args())


@torch.library.register_fake("cplib_c::ring_sdpa")
def _ring_sdpa_fake(q, k, v, *args):
    call = _call_of(args)
    sinks = args[ARGS] if len(args) > ARGS else None
    reject_real_in_fake("ring_sdpa", q, k, v, call.cu_seqlens, sinks, call.q_positions,
                        call.kv_positions)

    def checks():
        check_call("ring_sdpa", q, k, v, call)
        check_sinks("ring_sdpa", q, sinks)

    _fake_checks("ring_sdpa", call.group_name, (q, k, v), _describe("ring_sdpa", [q, k, v], call),
                 checks)
    b, h, s, _ = q.shape
    out = q.new_empty((b, h, s, v.shape[3]))
    lse = q.new_empty((b, h, s), dtype=acc_dtype(q.dtype))
    return out, lse


def _backward_fake(grad_out, q, k, v, out, lse, call: RingCall, describe: bool):
    reject_real_in_fake("ring_sdpa_backward", grad_out, q, k, v, out, lse, call.cu_seqlens,
                        call.q_positions, call.kv_positions)
    call = call.replace(ring_pass="kv")  # the backward runs the pass-KV ring

    def checks():
        check_call("ring_sdpa_backward", q, k, v, call)

    if describe:
        _fake_checks("ring_sdpa_backward", call.group_name, (q, k, v), _describe(
            "ring_sdpa_backward", [grad_out, q, k, v, out, lse], call), checks)
    else:  # covered by its forward's handshake: checks only, nothing communicates
        checks()
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@torch.library.register_fake("cplib_c::ring_sdpa_backward")
def _ring_sdpa_backward_fake(grad_out, q, k, v, out, lse, *args):
    return _backward_fake(grad_out, q, k, v, out, lse, _call_of(args), describe=True)


@torch.library.register_fake("cplib_c::ring_sdpa_backward_covered")
def _ring_sdpa_backward_covered_fake(agreed_record, grad_out, q, k, v, out, lse, *args):
    return _backward_fake(grad_out, q, k, v, out, lse, _call_of(args), describe=False)
