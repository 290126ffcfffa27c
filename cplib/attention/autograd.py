"""Autograd for an attention op that returns (out, lse) and has a backward
op of its own: the ring's (cplib/ring/op.py) and Ulysses' local attention
(cplib/ulysses/op.py) register it. Sinks get their gradient here, in Python;
the backward of a real-tensor forward runs without a handshake of its own
when the forward's covers it (one handshake per fwd+bwd)."""

from __future__ import annotations

import contextlib

import torch

from ..comm.handshake import tracing

__all__ = ["attention_autograd", "sinks_grad"]


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
