"""Autograd for ``cplib_c::ring_sdpa`` (ring attention over a
process group, implemented in C++: csrc/torch/ring/) and its Python
entry point ``ring_sdpa``. The argument checks are in cplib/ring/args.py and
check.py, the fake kernels in fake.py."""

from __future__ import annotations

import contextlib
import logging
from typing import Literal

import torch

from ..comm.handshake import agreed, tracing
from ..comm.native import GroupLike, group_name_of, ops
from . import fake  # noqa: F401  (registers the fake kernels)
from .host_copy import host_copy
from .args import (_is_fake, backend_arg, check_inputs, int_arg, rotate_arg, scale_arg,
                   window_arg)
from .call import ARGS, RingCall
from .names import RING_PASSES, layout_of

__all__ = ["ring_sdpa", "ring_attention", "ring_pass_auto"]

log = logging.getLogger("cplib")


def sinks_grad(grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
               sinks: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks from the sunk (out, lse): ``-sum over batch and rows of
    rowsum(dO * O) * exp(s - lse)``, this rank's rows only (parameters'
    gradients are summed over the context-parallel ranks, as for weights)."""
    acc = lse.dtype
    delta = (grad_out.to(acc) * out.to(acc)).sum(-1)
    prob = torch.exp(sinks.to(acc).view(1, -1, 1) - lse)
    return -(delta * prob).sum((0, 2)).to(sinks.dtype)


def _traced(q: torch.Tensor) -> bool:
    """handshake.tracing((q,)), without its checks for a plain tensor outside
    any dispatch mode and compile (what eager calls pass)."""
    if type(q) is torch.Tensor and not torch._C._len_torch_dispatch_stack() \
            and not torch.compiler.is_compiling():
        return False
    return tracing((q,))


def attention_autograd(backward_op, forward_op, covered_backward_op=None, agreed_record=None):
    """(setup_context, backward) for an attention op returning (out, lse)
    whose inputs are q, k, v and then non-tensor arguments, and whose
    ``backward_op(grad_out, q, k, v, out, lse, *args)`` gives (dq, dk, dv).
    A ``sinks`` argument of ``forward_op`` (found by name in its schema) is
    left out of ``args``: the backward kernel run with the sunk (out, lse) is
    already exact, and the sinks' own gradient is :func:`sinks_grad`.

    ``covered_backward_op`` (the same arguments after a first one, ``agreed``:
    what ``agreed_record()`` returns right after the forward: the group, the lengths,
    documents, positions and backend the forward agreed on, csrc/torch/ring/
    ring_agreed.h): the backward without a handshake of its own, which its
    forward's covers (one handshake per fwd+bwd), and which reads none of its
    inputs' values again. Used for real tensors; traced and fake ones
    (compile) keep ``backward_op``, which handshakes when it runs."""
    arguments = forward_op.default._schema.arguments
    names = [a.name for a in arguments]
    sinks_at = names.index("sinks") - 3 if "sinks" in names else None
    # The backward's arguments after (grad_out, q, k, v, out, lse), by name,
    # with the forward's defaults for those a caller left out.
    arg_names = [a.name for a in arguments[3:] if a.name != "sinks"]
    defaults = {a.name: a.default_value for a in arguments if a.has_default_value()}

    def setup(ctx, inputs, output):
        q, k, v, *args = inputs
        out, lse = output
        sinks = None
        ctx.sinks_at = sinks_at if sinks_at is not None and sinks_at < len(args) else None
        # Where the sinks are among the inputs autograd saw (needs_input_grad).
        ctx.sinks_input = None if ctx.sinks_at is None else 3 + ctx.sinks_at
        if ctx.sinks_at is not None:
            sinks = args[sinks_at]
            args = args[:sinks_at] + args[sinks_at + 1:]
        ctx.args = args
        ctx.agreed = None
        if covered_backward_op is not None and not _traced(q):
            # Plain meta tensors: the forward's fake kernel handshook (if due).
            if q.device.type == "meta":
                ctx.agreed = q.new_empty(0, dtype=torch.long)
            elif not torch._C._len_torch_dispatch_stack():
                ctx.agreed = agreed_record()
            else:
                # A host-side record, not part of the computation: dispatch
                # modes that run the ops for real (a FlopCounterMode, opcheck's
                # cross-check against fake tensors) do not see it.
                from torch.utils._python_dispatch import _disable_current_modes
                with _disable_current_modes():
                    ctx.agreed = agreed_record()
        ctx.has_sinks = sinks is not None
        ctx.save_for_backward(q, k, v, out, lse, *([sinks] if sinks is not None else []))
        # As for ATen's fused attention kernels, the log-sum-exp is an
        # auxiliary output that autograd does not differentiate.
        ctx.mark_non_differentiable(lse)
        # No zeros for the lse's (never used) gradient; a missing grad_out
        # is made below.
        ctx.set_materialize_grads(False)

    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, *sinks = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        # Without create_graph the backward op is not differentiated: below
        # autograd, the collectives' waits inside it skip their Python
        # autograd wrappers (torch's, on _c10d_functional::wait_tensor).
        below = (torch._C._AutoDispatchBelowAutograd() if not torch.is_grad_enabled()
                 else contextlib.nullcontext())
        with below:
            if ctx.agreed is not None:
                # The arguments a caller left out, as the forward's defaults.
                tail = [defaults[n] for n in arg_names[len(ctx.args):]]
                dq, dk, dv = covered_backward_op(ctx.agreed, grad_out, q, k, v, out, lse,
                                                 *ctx.args, *tail)
            else:
                dq, dk, dv = backward_op(grad_out, q, k, v, out, lse, *ctx.args)
        grads = [None] * len(ctx.args)
        if ctx.sinks_at is not None:
            ds = None
            if ctx.has_sinks and ctx.needs_input_grad[ctx.sinks_input]:
                ds = sinks_grad(grad_out, out, lse, sinks[0])
            grads.insert(ctx.sinks_at, ds)
        return (dq, dk, dv, *grads)

    return setup, backward


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


def ring_sdpa(
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring attention of the local shards ``q`` (B, Hq, S_local, D) and ``k``/``v``
    (B, Hkv, S_local, D; v's head dim may differ from q/k's, as in MLA) over
    ``group`` (a ProcessGroup or its name).

    Returns ``(out, lse)``: ``out`` (B, Hq, S_local, D_v) in q's dtype and ``lse``
    (B, Hq, S_local), float32 (float64 for float64 inputs), the natural-log
    log-sum-exp of the scaled scores over every key of the global sequence.
    With ``load_balanced`` the shards are in head-tail layout (rank r holds
    chunks r and 2N-1-r of 2N). K/V rotate with their own Hkv heads (GQA).
    ``rotate`` is "p2p", "alltoall", "allgather" or "auto" (chosen by
    cplib's cost model for these shapes, mask and group, agreed across the
    ranks, cached; cplib/strategy/; "p2p" with explicit positions or
    pass-Q); ``backend`` is None/"auto",
    "flash", "efficient" or "cudnn" (CUDA only; CPU always uses flash).
    Only ``out`` is differentiable.

    ``cu_seqlens`` (integer tensor ``[0, s1, ..., S]`` of global document
    boundaries, the same on every rank): attention stays within each document
    (causal within it with ``is_causal``). ``window``: ``(left, right)`` or
    ``w`` for ``(w, w)``; query i sees key j iff ``i - left <= j <= i + right``
    in global positions (``None`` on a side: no limit; ``is_causal`` makes
    right 0). ``seq_len``: the global length S when the shards are uneven
    (any S >= world size; see ``cplib.ring.layout``); by default S is the
    local length times the world size. Blocks nobody can see are neither
    computed nor sent (p2p and alltoall). ``per_document``: the shards are
    cut head-tail inside every document (``cplib.ring.layout`` with
    ``documents``; needs ``cu_seqlens`` and ``seq_len``). ``placement``: the
    shards are in the document placement of
    :class:`cplib.DocumentPlacementLoadBalancer` (documents kept whole on one
    rank where the balance allows; needs ``cu_seqlens`` and ``seq_len``).

    ``sinks`` (Hq,): attention sinks (gpt-oss), one logit per q head that
    joins every row's softmax denominator once and contributes no value;
    ``out`` and ``lse`` then include it. Differentiable in ``sinks`` too
    (its gradient covers this rank's rows).

    ``q_positions`` / ``kv_positions`` (1-D integer tensors, both or
    neither): the global positions of this rank's q rows and k/v rows, in
    local order, the same for every batch row. The mask is then read on them
    (causal: ``kv_pos <= q_pos``; the window and the documents likewise), the
    ranks may hold different lengths (zero queries too), and q and k/v may
    cover different tokens: T new queries against a persistent cache of P + T
    keys. They exclude ``load_balanced``, ``seq_len`` and ``per_document``.

    ``ring_pass``: "kv" rotates k/v (differentiable); "q" rotates the queries
    and returns each partial (out, lse) to its owner (forward only: cheaper
    when few new queries meet a long cache); "auto" picks the one that moves
    fewer bytes (:func:`ring_pass_auto`), and "kv" whenever a gradient is
    needed. The choice is logged at debug level on the "cplib" logger.

    ``attn_mask``: a key-padding mask (boolean, True = attend, or additive)
    of this rank's keys, broadcastable to (B, 1, 1, S_local); it travels with
    its K/V block (cplib/ring/key_padding.py). Other shapes raise
    NotImplementedError.

    Every call begins with cplib's handshake (see
    :func:`cplib.consistency_checks`): every rank raises the same error, or
    none does; its backward through autograd is covered by it (one handshake
    per fwd+bwd). Plain meta tensors on a real process group compute shapes
    only but take part in the handshake, so a rank on meta tensors beside
    ranks on real ones raises the same ValueError naming the device on every
    rank; under FakeTensorMode or torch.compile nothing communicates. On an
    NCCL group, call :func:`cplib.register_group` once on every rank so that
    the handshake runs in host memory (no wait for the GPU).
    """
    name = group_name_of(group)
    wants_grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v))
    auto_rotate = isinstance(rotate, str) and rotate == "auto"  # cplib/strategy

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
                        rotate_arg("ring_sdpa", "p2p" if auto_rotate else rotate), cu_seqlens,
                        window_arg(window), int_arg("ring_sdpa", "seq_len", seq_len),
                        q_positions, kv_positions, "kv" if wants_grad else ring_pass)

    call = agreed("ring_sdpa", name, (q, k, v, cu_seqlens), args, meta_joins=True)
    out = ring_attention(q, k, v, call, sinks=sinks, attn_mask=attn_mask,
                         auto_rotate=auto_rotate)
    if ring_pass == "auto" and log.isEnabledFor(logging.DEBUG) and not _is_fake(q):
        log.debug("cplib.ring_sdpa: ring_pass='auto' chose %r%s", ops.ring_debug_last_pass(),
                  " (a gradient is needed)" if wants_grad else "")
    return out


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: RingCall, *,
                   sinks: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
                   auto_rotate: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ring_sdpa` of a checked call (its arguments agreed: the front
    end's routed SDPA calls come here directly): the key-padding mask folded
    into q and k, host copies of the plan's integer tensors, the rotation of
    ``auto_rotate``, then the op (through autograd when a gradient is due)."""
    if attn_mask is not None:
        from .key_padding import key_padding_inputs

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
    if auto_rotate and not call.has_positions and call.ring_pass != "q":
        from ..strategy.auto import ring_rotation
        call = call.replace(rotate=ring_rotation(q, k, v, call, backward=grad))
    # Compiled graphs keep the op itself (its registered autograd and fake).
    if torch.compiler.is_compiling():
        return ops.ring_sdpa(q, k, v, *call.op_args(), sinks)
    if not grad:  # nothing to differentiate: below torch.library's autograd wrapper
        with torch._C._AutoDispatchBelowAutograd():
            return ops.ring_sdpa(q, k, v, *call.op_args(), sinks)
    return _RingSdpaFunction.apply(q, k, v, sinks, call)


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


