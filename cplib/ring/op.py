"""Autograd for ``cplib_c::ring_sdpa`` (ring attention over a
process group, implemented in C++: csrc/torch/ring/) and the ring's Python
entry: its arguments checked and agreed (``ring_inputs``), then run
(``ring_run``). ``cplib.ring_sdpa`` (entry.py) resolves ``rotate="auto"``
between the two. The argument checks are in
cplib/attention/args.py and cplib/ring/args.py and check.py, the fake
kernels in fake.py."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Literal

import torch

from ..attention.args import backend_arg, check_inputs, int_arg, is_fake, scale_arg, window_arg
from ..attention.autograd import attention_autograd
from ..attention.key_padding import key_padding_inputs
from ..attention.names import RING_PASSES, layout_of
from ..comm.handshake import agreed
from ..comm.native import GroupLike, group_name_of, ops
from . import fake  # noqa: F401  (registers the fake kernels)
from .args import rotate_arg
from .call import ARGS, RingCall
from .host_copy import host_copy

__all__ = ["RingInputs", "ring_inputs", "ring_run", "ring_sdpa", "ring_attention",
           "ring_pass_auto"]

log = logging.getLogger("cplib")


_setup, _backward = attention_autograd(ops.ring_sdpa_backward, ops.ring_sdpa,
                                       ops.ring_sdpa_backward_covered, ops.ring_agreed_record)
torch.library.register_autograd("cplib_c::ring_sdpa", _backward, setup_context=_setup)


class _RingSdpaFunction(torch.autograd.Function):
    """The registered formula above, applied directly by :func:`ring_attention`
    in eager mode: torch.library's wrapper refills the schema's defaults on
    every call (``fill_defaults``, about 150 us of host time for these 16
    arguments, more than the ring's own host work at small sizes). The call
    is one argument here (``apply`` processes each of its arguments)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, call):
        args = (*call.op_args(), sinks)
        with torch._C._AutoDispatchBelowAutograd():
            output = ops.ring_sdpa(q, k, v, *args)
        _setup(ctx, (q, k, v, *args), output)
        ctx.sinks_input = 3  # this Function's inputs: q, k, v, sinks, call
        return output

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        # The formula's gradients are by the op's arguments: q, k, v, the
        # call's and then the sinks'.
        grads = _backward(ctx, grad_out, grad_lse)
        return (*grads[:3], grads[-1] if len(grads) > 3 + ARGS else None, None)


@dataclass(frozen=True, slots=True, eq=False)
class RingInputs:
    """A checked, agreed ring call with its tensors as the op takes them (the
    key-padding mask folded into q and k, host copies of the plan's integer
    tensors): what :func:`ring_run` runs. ``grad``: a gradient is due;
    ``pass_note``: None, or the note of the debug log of ``ring_pass="auto"``."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    call: RingCall
    sinks: torch.Tensor | None = None
    grad: bool = False
    pass_note: str | None = None

    def with_rotation(self, rotate: str) -> RingInputs:
        return dataclasses.replace(self, call=self.call.replace(rotate=rotate))


def prepared(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: RingCall,
             sinks: torch.Tensor | None = None,
             attn_mask: torch.Tensor | None = None) -> RingInputs:
    """The inputs of a checked call: the key-padding mask folded into q and k,
    host copies of the plan's integer tensors."""
    if attn_mask is not None:
        # A mask rejected on one rank is rejected on every rank (the handshake).
        q, k, v, scale, _ = agreed("ring_sdpa", call.group_name, (q, k, v, attn_mask),
                                   lambda: key_padding_inputs("ring_sdpa", attn_mask, q, k, v,
                                                              call.scale))
        call = call.replace(scale=scale)
    if call.cu_seqlens is not None or call.has_positions:
        # The plan reads these on the host: GPU tensors once per version (host_copy.py).
        call = call.replace(cu_seqlens=host_copy(call.cu_seqlens),
                            q_positions=host_copy(call.q_positions),
                            kv_positions=host_copy(call.kv_positions))
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                        or (sinks is not None and sinks.requires_grad))
    return RingInputs(q, k, v, call, sinks, grad)


def ring_run(inputs: RingInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The op on prepared inputs (through autograd when a gradient is due)."""
    q, k, v, call, sinks = inputs.q, inputs.k, inputs.v, inputs.call, inputs.sinks
    # Compiled graphs keep the op itself (its registered autograd and fake).
    if torch.compiler.is_compiling():
        out = ops.ring_sdpa(q, k, v, *call.op_args(), sinks)
    elif not inputs.grad:  # nothing to differentiate: below torch.library's autograd wrapper
        with torch._C._AutoDispatchBelowAutograd():
            out = ops.ring_sdpa(q, k, v, *call.op_args(), sinks)
    else:
        out = _RingSdpaFunction.apply(q, k, v, sinks, call)
    if inputs.pass_note is not None and log.isEnabledFor(logging.DEBUG) and not is_fake(q):
        log.debug("cplib.ring_sdpa: ring_pass='auto' chose %r%s", ops.ring_debug_last_pass(),
                  inputs.pass_note)
    return out


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: RingCall, *,
                   sinks: torch.Tensor | None = None,
                   attn_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ring_sdpa` of a checked call (its arguments agreed, its rotation
    explicit: the front end's routed SDPA calls come here directly)."""
    return ring_run(prepared(q, k, v, call, sinks, attn_mask))


def ring_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: GroupLike,
    *,
    is_causal: bool = False,
    load_balanced: bool = False,
    scale: float | None = None,
    rotate: str = "p2p",
    backend: str | None = None,
    cu_seqlens: torch.Tensor | None = None,
    window: int | tuple[int | None, int | None] | None = None,
    seq_len: int | None = None,
    per_document: bool = False,
    sinks: torch.Tensor | None = None,
    q_positions: torch.Tensor | None = None,
    kv_positions: torch.Tensor | None = None,
    ring_pass: Literal["kv", "q", "auto"] = "kv",
    attn_mask: torch.Tensor | None = None,
    placement: bool = False,
) -> RingInputs:
    """The arguments of :func:`cplib.ring_sdpa` (documented there:
    cplib/ring/entry.py) checked, agreed across the ranks and prepared;
    ``rotate`` is an explicit rotation: "auto" is resolved by the entry,
    with the strategy's cost model."""
    name = group_name_of(group)
    wants_grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v))

    def args() -> RingCall:
        check_inputs("ring_sdpa", q=q, k=k, v=v, cu_seqlens=cu_seqlens, sinks=sinks,
                     q_positions=q_positions, kv_positions=kv_positions)
        if not isinstance(ring_pass, str) or ring_pass not in RING_PASSES:
            raise ValueError(f"cplib.ring_sdpa: ring_pass={ring_pass!r} is not one of "
                             f"{', '.join(map(repr, RING_PASSES))}")
        if ring_pass == "q" and wants_grad:
            raise ValueError("cplib.ring_sdpa: ring_pass='q' is forward only, but q, k or v "
                             "requires grad: use ring_pass=\"kv\" (or run under "
                             "torch.no_grad())")
        return RingCall(name, bool(is_causal),
                        layout_of("ring_sdpa", load_balanced, per_document, placement),
                        scale_arg("ring_sdpa", scale), backend_arg("ring_sdpa", backend),
                        rotate_arg("ring_sdpa", rotate), cu_seqlens,
                        window_arg(window), int_arg("ring_sdpa", "seq_len", seq_len),
                        q_positions, kv_positions, "kv" if wants_grad else ring_pass)

    call = agreed("ring_sdpa", name, (q, k, v, cu_seqlens), args, meta_joins=True)
    inputs = prepared(q, k, v, call, sinks, attn_mask)
    if ring_pass != "auto":
        return inputs
    return dataclasses.replace(inputs, pass_note=" (a gradient is needed)" if wants_grad else "")


def ring_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: GroupLike,
              **options) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`cplib.ring_sdpa` with an explicit rotation, for the callers that
    never choose one (USP, the DTensor path): the same arguments."""
    return ring_run(ring_inputs(q, k, v, group, **options))


def ring_pass_auto(q_tokens: int, kv_tokens: int, q_heads: int, kv_heads: int, head_dim: int,
                   v_head_dim: int | None = None, dtype: torch.dtype = torch.float32,
                   requires_grad: bool = False) -> Literal["kv", "q"]:
    """The ring pass ``ring_pass="auto"`` picks: "q" when sending every query
    (``q_tokens * q_heads * head_dim`` elements) and returning its partial
    out and lse (``q_tokens * q_heads * (v_head_dim + 1)`` in the accumulator
    dtype, float32 or float64) moves fewer bytes than sending every key and
    value (``kv_tokens * kv_heads * (head_dim + v_head_dim)``); else "kv".
    Token counts are global (summed over the ranks). Always "kv" when a
    gradient is needed. The same rule as csrc/torch/ring/ring_args.cpp."""
    if requires_grad:
        return "kv"
    dv = head_dim if v_head_dim is None else v_head_dim
    elem = torch.empty((), dtype=dtype).element_size()
    acc = 8 if dtype == torch.float64 else 4
    kv_bytes = kv_tokens * kv_heads * (head_dim + dv) * elem
    q_bytes = q_tokens * q_heads * (head_dim * elem + (dv + 1) * acc)
    return "q" if q_bytes < kv_bytes else "kv"


