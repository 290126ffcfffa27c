"""Fake kernels of ``cplib_c::ring_sdpa`` and its backward ops: shapes for
tracing and compile, the argument checks, and on plain meta tensors the
handshake (a rank on meta tensors beside ranks on real ones raises with
them)."""

from __future__ import annotations

import torch

from ..comm.handshake import agreed, can_handshake, tracing
from ..comm.native import ops, reject_real_in_fake
from .args import _acc_dtype, check_sinks
from .check import _check


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


@torch.library.register_fake("cplib_c::ring_sdpa")
def _ring_sdpa_fake(q, k, v, group_name, is_causal, load_balanced, scale, backend, rotate,
                    cu_seqlens=None, window=None, seq_len=None, per_document=False, sinks=None,
                    q_positions=None, kv_positions=None, ring_pass=0, placement=False):
    reject_real_in_fake("ring_sdpa", q, k, v, cu_seqlens, sinks, q_positions, kv_positions)

    def checks():
        _check("ring_sdpa", q, k, v, group_name, is_causal, load_balanced, scale, backend,
               rotate, cu_seqlens, window, seq_len, per_document, q_positions, kv_positions,
               ring_pass, placement)
        check_sinks("ring_sdpa", q, sinks)

    _fake_checks("ring_sdpa", group_name, (q, k, v), lambda: ops.ring_describe_call(
        "ring_sdpa", [q, k, v], group_name, is_causal, load_balanced, scale, backend, rotate,
        cu_seqlens, window, seq_len, per_document, q_positions, kv_positions, ring_pass,
        placement), checks)
    b, h, s, _ = q.shape
    out = q.new_empty((b, h, s, v.shape[3]))
    lse = q.new_empty((b, h, s), dtype=_acc_dtype(q.dtype))
    return out, lse


@torch.library.register_fake("cplib_c::ring_sdpa_backward")
def _ring_sdpa_backward_fake(grad_out, q, k, v, out, lse, group_name, is_causal, load_balanced,
                             scale, backend, rotate, cu_seqlens=None, window=None, seq_len=None,
                             per_document=False, q_positions=None, kv_positions=None,
                             ring_pass=0, placement=False):
    reject_real_in_fake("ring_sdpa_backward", grad_out, q, k, v, out, lse, cu_seqlens, q_positions,
                        kv_positions)

    def checks():
        _check("ring_sdpa_backward", q, k, v, group_name, is_causal, load_balanced, scale,
               backend, rotate, cu_seqlens, window, seq_len, per_document, q_positions,
               kv_positions, placement=placement)

    _fake_checks("ring_sdpa_backward", group_name, (q, k, v), lambda: ops.ring_describe_call(
        "ring_sdpa_backward", [grad_out, q, k, v, out, lse], group_name, is_causal,
        load_balanced, scale, backend, rotate, cu_seqlens, window, seq_len, per_document,
        q_positions, kv_positions, ring_pass, placement), checks)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@torch.library.register_fake("cplib_c::ring_sdpa_backward_covered")
def _ring_sdpa_backward_covered_fake(grad_out, q, k, v, out, lse, group_name, is_causal,
                                     load_balanced, scale, backend, rotate, cu_seqlens, window,
                                     seq_len, per_document, q_positions, kv_positions, ring_pass,
                                     placement, agreed_record):
    # Covered by its forward's handshake: checks only, nothing communicates.
    reject_real_in_fake("ring_sdpa_backward", grad_out, q, k, v, out, lse, cu_seqlens, q_positions,
                        kv_positions)
    _check("ring_sdpa_backward", q, k, v, group_name, is_causal, load_balanced, scale, backend,
           rotate, cu_seqlens, window, seq_len, per_document, q_positions, kv_positions,
           placement=placement)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

