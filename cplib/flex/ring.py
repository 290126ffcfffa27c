"""Flex attention as a ring: each rank keeps its queries and visits the K/V
rows its BlockMask needs (the plan, ``plan.py``), one flex_attention call per
visited block, merged exactly through the log-sum-exps with cplib's merge
kernel (``cplib_c::merge_partial_``).

flex_attention is a Python higher-order op, so the loop is Python; the
exchanges are cplib ops (``ring_ops.py``). The backward holds one visiting
block at a time: it fetches each block again and computes its gradients
for the global loss, then sends the block's dK|dV back to its owner.

Without a score_mod it calls flex's backward op on the block with the
merged output O and lse of its query rows (the block's softmax is
exp(s - lse), a slice of the global one): no block's forward runs again.
With a score_mod (see FlexRingCall.direct_backward) it recomputes the block's
(o_b, lse_b) once with autograd and backpropagates

    grad o_b   = w_b * dO,                                   w_b = exp(lse_b - LSE)
    grad lse_b = rowsum(grad o_b * o_b) - w_b * (rowsum(dO * O) - dLSE)

(exact: O = sum_b w_b o_b and LSE = logsumexp_b lse_b; the first term of
grad lse_b cancels the one flex's own backward subtracts). Under
torch.compile the recomputation's ``torch.autograd.grad`` is traced
(dynamo's ``trace_autograd_ops``, switched on for that region only), so a
compiled model stays one graph.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.attention.flex_attention as fa
from torch._dynamo.decorators import DynamoConfigPatchProxy
from torch.nn.attention.flex_attention import AuxRequest

from ..attention.args import acc_dtype
from ..merge.op import merge_partial_
from .plan import FlexShard, RingStep, positions_mod
from .ring_ops import pack, ring_begin, ring_end, ring_shift

__all__ = ["FlexRingCall", "ring_attention"]

# flex's backward op (see FlexRingCall.direct_backward).
_FLEX_BACKWARD = torch.ops.higher_order.flex_attention_backward


def _dynamo_traces_flex_backward() -> bool:
    """Whether dynamo traces a call of flex's backward op given a Python
    score_mod (torch 2.13 and 2.15 derive its graphs; 2.11's dynamo takes
    only graphs traced before, and fails)."""
    from torch._dynamo.variables.higher_order_ops import FlexAttentionBackwardHighOrderVariable

    return hasattr(FlexAttentionBackwardHighOrderVariable, "_derive_joint_graph")


_DIRECT_BACKWARD_TRACEABLE = _dynamo_traces_flex_backward()
# Lets dynamo trace the backward's torch.autograd.grad (and nothing else):
# entered around that call only.
_TRACE_AUTOGRAD = DynamoConfigPatchProxy(torch._dynamo.config.patch(trace_autograd_ops=True))
# torch 2.11's dynamo cannot trace requires_grad_() (2.13 can): see _leaf.
_REQUIRES_GRAD_TRACEABLE = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 13)


class FlexRingCall:
    """Everything one flex ring call needs besides q, k and v, made from the
    call's record (call.py's FlexCall) and its mask's plan. (The SDPA ring's
    record is cplib.ring.call.RingCall.)"""

    def __init__(self, shard: FlexShard, score_mod: Callable | None, scale: float | None,
                 enable_gqa: bool, kernel_options: dict[str, Any] | None) -> None:
        self.shard = shard
        self.scale = scale
        self.enable_gqa = enable_gqa
        self.kernel_options = kernel_options
        # Without a score_mod the backward calls flex's backward op directly
        # (where dynamo can trace that call). With one it recomputes each
        # block's forward under autograd instead: dynamo derives a direct
        # call's score_mod gradient without TransformGetItemToIndex (torch
        # 2.13), so a score_mod indexing a captured tensor (ours do, for
        # global positions) fails to trace.
        self.direct_backward = score_mod is None and _DIRECT_BACKWARD_TRACEABLE
        # One score_mod per step, on global positions (shared by fwd and bwd).
        self.score_mods = tuple(
            None if score_mod is None else
            positions_mod(score_mod, s.q_positions, s.kv_positions, score=True)
            for s in shard.steps)


def _message(k: torch.Tensor, v: torch.Tensor, step: RingStep,
             whole: list[torch.Tensor]) -> torch.Tensor:
    """Our K|V rows that ``step.dst`` needs, in one flat buffer (the whole
    shard is packed once per pass and reused: ``whole`` caches it)."""
    if step.send_rows == 0:
        return k.new_empty((0,))
    if step.send_index is None:
        if not whole:
            whole.append(pack((k, v)))
        return whole[0]
    return pack((k.index_select(2, step.send_index), v.index_select(2, step.send_index)))


def _unpack(flat: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (k, v) of ``rows`` rows packed in ``flat`` (views)."""
    b, h = k.shape[:2]
    nk = b * h * rows * k.shape[3]
    return (flat[:nk].view(b, h, rows, k.shape[3]),
            flat[nk:].view(b, v.shape[1], rows, v.shape[3]))


def _row_numel(k: torch.Tensor, v: torch.Tensor) -> int:
    """Elements of one sequence row of k and v together."""
    return k.shape[0] * (k.shape[1] * k.shape[3] + v.shape[1] * v.shape[3])


def _fetch(k, v, step: RingStep, after: torch.Tensor, whole: list,
           group_name: str) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Step ``step``'s exchange: sends our rows to ``step.dst``, returns
    ``(token, k_b, v_b)`` with the rows of ``step.src`` (None when none)."""
    recv, token = ring_shift(_message(k, v, step, whole), after, step.dst,
                             step.recv_rows * _row_numel(k, v), step.src, group_name)
    if step.recv_rows == 0:
        return token, None, None
    kb, vb = _unpack(recv, k, v, step.recv_rows)
    return token, kb, vb


def _span(step: RingStep) -> tuple[int, int]:
    """The step's query rows [start, end), read from its string (see RingStep.q_span)."""
    start, end = step.q_span.split(":")
    return int(start), int(end)


def _rows_of(t: torch.Tensor, step: RingStep) -> torch.Tensor:
    """The query rows of ``t`` (dim 2) that ``step`` attends with (a view)."""
    start, end = _span(step)
    return t if (start, end) == (0, t.shape[2]) else t[:, :, start:end]


def _attend(q, kb, vb, step: RingStep, score_mod, call: FlexRingCall):
    """(o_b, lse_b) of the step's query rows ``q`` (``_rows_of``)."""
    out, aux = fa.flex_attention(q, kb, vb, score_mod=score_mod, block_mask=step.mask,
                                 scale=call.scale, enable_gqa=call.enable_gqa,
                                 kernel_options=call.kernel_options,
                                 return_aux=AuxRequest(lse=True))
    return out, aux.lse


def _forward(q, k, v, token, call: FlexRingCall, group_name: str):
    acc = acc_dtype(q.dtype)
    b, h, rows = q.shape[:3]
    out = q.new_zeros((b, h, rows, v.shape[3]), dtype=acc)
    lse = q.new_full((b, h, rows), -math.inf, dtype=acc)
    whole: list[torch.Tensor] = []
    for step, score_mod in zip(call.shard.steps, call.score_mods):
        kb, vb = k, v
        if step.offset:
            token, kb, vb = _fetch(k, v, step, token, whole, group_name)
        if step.compute:
            o_b, lse_b = _attend(_rows_of(q, step), kb, vb, step, score_mod, call)
            merge_partial_(out, lse, o_b, lse_b.to(acc), _span(step)[0])
            o_b = lse_b = None  # released before the next exchange
    return out, ring_end(lse, token)


def _leaf(t: torch.Tensor, anchor_src: torch.Tensor) -> torch.Tensor:
    """``t`` as a fresh tensor that requires grad, for autograd.grad to ask
    for its gradient: never ``t`` itself, whose history may hold other
    inputs (``model(x, x, x)``). ``anchor_src``: an input that requires grad."""
    if _REQUIRES_GRAD_TRACEABLE or not torch.compiler.is_compiling():
        return t.detach().requires_grad_()
    # torch 2.11's dynamo cannot trace requires_grad_(): add a zero that requires grad.
    return t.detach() + (anchor_src.reshape(-1)[:1] * 0).sum().to(t.dtype)


def _like(lse_b: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``grad`` in the dtype ``lse_b`` has when the graph runs, not when it
    is traced: flex's fake kernel gives its lse float32 whatever the inputs
    (torch/_higher_order_ops/flex_attention.py: flex_attention_fake_impl),
    while its dense implementation returns float64 for float64 inputs. A
    ``.to(lse_b.dtype)`` traced with the fake dtype, or the cast autograd
    makes to a traced output's dtype, would round a float64 gradient to
    float32 (dq and dk off by 3e-8 to 5e-8; tests/flex/test_flex_ring_float64.py);
    a copy into a tensor like ``lse_b`` takes its dtype at run time."""
    return torch.empty_like(lse_b).copy_(grad)


def _block_grads(q, kb, vb, lse, d_out, delta, step, score_mod, call, need_q, need_kv,
                 anchor_src):
    """(dq, dk_b, dv_b) of one visited block for the global loss: the
    block's forward recomputed once, backpropagated with the weights that
    the merge gave it (see the module docstring): ``delta`` is
    ``rowsum(dO * O) - dLSE``; ``anchor_src`` a saved input that requires
    grad (see _leaf). dq covers the step's query rows only."""
    lse, d_out, delta = (_rows_of(t, step) for t in (lse, d_out, delta))
    with torch.enable_grad(), _TRACE_AUTOGRAD:
        q = _rows_of(q, step)  # a view taken with grad on: its gradient is asked for
        kv = (_leaf(kb, anchor_src), _leaf(vb, anchor_src)) if need_kv else (kb, vb)
        inputs = ((q,) if need_q else ()) + (kv if need_kv else ())
        o_b, lse_b = _attend(q, *kv, step, score_mod, call)
        w = torch.exp(lse_b.detach().to(lse.dtype) - lse)
        grad_o = (w.unsqueeze(-1) * d_out).to(o_b.dtype)
        # rowsum(grad_o * o_b) is what flex's backward subtracts (its delta),
        # computed alike so that it cancels; the rest is the global delta.
        delta_b = (o_b.detach().to(delta.dtype) * grad_o.to(delta.dtype)).sum(-1)
        grad_lse = _like(lse_b, delta_b - w * delta)
        grads = torch.autograd.grad((o_b, lse_b), inputs, (grad_o, grad_lse))
    dq = grads[0] if need_q else None
    dk, dv = grads[-2:] if need_kv else (None, None)
    return dq, dk, dv


def _direct_backward_args(q, k, v, lse, d_lse, call: FlexRingCall):
    """What every step's call of flex's backward op shares, computed once:
    lse and its gradient in the op's base, the scale, the kernel options."""
    options = fa._apply_kernel_options(q, k, v, False, call.kernel_options, AuxRequest(lse=True))
    # The op's lse is in base 2 (every backend but FLASH); ours is natural.
    to_op = 1.0 / math.log(2.0) if options.get("BACKEND") != "FLASH" else 1.0
    scale = call.scale if call.scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return lse * to_op, d_lse / to_op, scale, options


def _block_grads_direct(q, kb, vb, out, d_out, step: RingStep, op_args):
    """(dq, dk_b, dv_b) of one visited block without a score_mod: flex's own
    backward on the block, given the merged output and lse of the step's
    query rows, so the block's forward is not computed again (see the
    module docstring; dq covers those rows only). ``op_args``: from
    _direct_backward_args."""
    lse, d_lse, scale, options = op_args
    q, out, lse, d_out, d_lse = (_rows_of(t, step) for t in (q, out, lse, d_out, d_lse))
    mask = step.mask if step.mask is not None else fa._create_empty_block_mask(q, kb)
    # Grad mode on: the op derives score_mod's backward graph by tracing it.
    with torch.enable_grad():
        dq, dk, dv, _ = _FLEX_BACKWARD(q, kb, vb, out, lse, d_out, d_lse, fa._identity, None,
                                       mask.as_tuple(), scale, options, (), ())
    if dk.shape != kb.shape:  # keys broadcast over the batch
        dk, dv = dk.sum(0, keepdim=True), dv.sum(0, keepdim=True)
    return dq, dk, dv


def _absorb(dk, dv, recv, k, v, step: RingStep) -> None:
    """Adds the gradient of our rows that ``step.dst`` sent back (``recv``)."""
    rk, rv = _unpack(recv, k, v, step.send_rows)
    if step.send_index is None:
        dk += rk
        dv += rv
    else:
        dk.index_add_(2, step.send_index, rk.to(dk.dtype))
        dv.index_add_(2, step.send_index, rv.to(dv.dtype))


def _backward(q, k, v, out, lse, d_out, d_lse, call: FlexRingCall, group_name: str,
              need_q: bool, need_kv: bool):
    acc = acc_dtype(q.dtype)
    # Rows no key sees (lse -inf) get weight 0 from every block.
    lse = torch.where(lse == -math.inf, torch.zeros_like(lse), lse)
    if call.direct_backward:
        d_out = d_out.to(q.dtype)
        op_args = _direct_backward_args(q, k, v, lse, d_lse, call)
    else:
        d_out = d_out.to(acc)
        delta = (d_out * out.to(acc)).sum(-1) - d_lse.to(acc)
        anchor_src = next(t for t in (k, v, q) if t.requires_grad)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device) if need_q else None
    dk = torch.zeros(k.shape, dtype=acc, device=k.device) if need_kv else None
    dv = torch.zeros(v.shape, dtype=acc, device=v.device) if need_kv else None
    token, whole = d_out, []
    for step, score_mod in zip(call.shard.steps, call.score_mods):
        kb, vb = k, v
        if step.offset:
            token, kb, vb = _fetch(k, v, step, token, whole, group_name)
        gk = gv = None
        if step.compute:
            if call.direct_backward:
                gq, gk, gv = _block_grads_direct(q, kb, vb, out, d_out, step, op_args)
            else:
                gq, gk, gv = _block_grads(q, kb, vb, lse, d_out, delta, step, score_mod, call,
                                          need_q, need_kv, anchor_src)
            if need_q:
                _rows_of(dq, step).add_(gq)
            gq = None
        if not need_kv:
            continue
        if step.offset == 0:
            if gk is not None:
                dk += gk
                dv += gv
            continue
        # The visited block's gradient goes back to its owner; ours comes
        # back from the rank that visited our rows.
        send = pack((gk, gv)) if gk is not None else k.new_empty((0,))
        gk = gv = kb = vb = None  # released before the exchange
        recv, token = ring_shift(send, token, step.src, step.send_rows * _row_numel(k, v),
                                 step.dst, group_name)
        del send
        if step.send_rows:
            _absorb(dk, dv, recv, k, v, step)
        recv = None
    grads = [None if g is None else g.to(t.dtype) for g, t in ((dq, q), (dk, k), (dv, v))]
    last = 2 if need_kv else 0
    grads[last] = ring_end(grads[last], token)
    return tuple(grads)


class _FlexRing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, token, call, group_name):
        out, lse = _forward(q, k, v, token, call, group_name)
        if out.dtype != q.dtype:  # (a no-op .to() here hides d_out on torch 2.11)
            out = out.to(q.dtype)
        ctx.call, ctx.group_name = call, group_name
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, out, lse = ctx.saved_tensors
        need_q = ctx.needs_input_grad[0]
        need_kv = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        dq, dk, dv = _backward(q, k, v, out, lse, d_out, d_lse, ctx.call, ctx.group_name,
                               need_q, need_kv)
        return dq, dk, dv, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: FlexRingCall,
                   fields: dict[str, int], group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of this rank's queries over the whole sequence; ``fields``
    join the call's handshake (inputs already checked)."""
    # Detached: the token carries no gradient (and the op has no autograd).
    token = ring_begin(q.detach(), k.detach(), v.detach(), fields, group_name)
    # model(x, x, x): dynamo traces no autograd function given one tensor
    # twice, so each role gets its own view (their gradients still add up).
    if k is q:
        k = k.view_as(k)
    if v is q or v is k:
        v = v.view_as(v)
    return _FlexRing.apply(q, k, v, token, call, group_name)
