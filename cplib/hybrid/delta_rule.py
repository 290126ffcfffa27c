"""The (gated) delta rule under context parallelism: Gated DeltaNet (Qwen3-Next,
Qwen3.5, OLMo hybrid) and Kimi Delta Attention (per-channel gates), computed
by the user's own chunk kernel (fla's ``chunk_gated_delta_rule`` /
``chunk_kda`` on GPU, transformers' torch versions on CPU) with an exchange
around it. Two ways, chosen per call (cplib/hybrid/choice.py):

* ``"state"`` (state passing, any number of ranks): the recurrence
  ``S_t = exp(g_t)(I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T`` is affine in
  the state with a transition that does not depend on ``v``. So one kernel
  call on ``v`` widened by ``d_k`` zero columns, from the initial state
  ``[0 | I]``, returns in its final state both the piece's zero-start state
  ``Z`` and its transition ``M`` (``[Z | M]``), and in its output both the
  zero-start output ``o0`` and ``P_t = (transition up to t)^T q_t``. After
  the exchange of ``(Z, M)`` (cplib/hybrid/state.py) the output is
  ``o_t = o0_t + P_t^T S_in``: exact, no second kernel call.
* ``"heads"`` (Ulysses-style, linear key heads divisible by N): one
  all-to-all per dtype trades the sequence shard of every stream for all of
  the sequence on N-th of the heads, the kernel runs on the whole sequence
  in order, and one all-to-all brings the output back.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .layout import SequenceLayout
from .reshard import heads_to_sequence, sequence_to_heads
from .state import incoming_states

__all__ = ["delta_rule_by_state", "delta_rule_by_heads"]

Kernel = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def _split_pieces(layout: SequenceLayout, tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Per local piece, the slices of (B, L, ...) ``tensors``."""
    sizes = [n for _, n in layout.pieces()]
    return [list(parts) for parts in zip(*(t.split(sizes, dim=1) for t in tensors))]


def _widened_call(kernel: Kernel, q, k, v, g, beta, kw: dict) -> tuple:
    """One kernel call from ``[0 | I]`` on ``[v | 0]``: (o0, P, Z, M)."""
    b, _, hv, dv = v.shape
    dk = k.shape[-1]
    v_wide = torch.cat([v, v.new_zeros(*v.shape[:3], dk)], dim=-1)
    start = torch.zeros(b, hv, dk, dv + dk, dtype=torch.float32, device=v.device)
    start[..., dv:] = torch.eye(dk, dtype=torch.float32, device=v.device)
    out, final = kernel(q, k, v_wide, g=g, beta=beta, initial_state=start,
                        output_final_state=True, **kw)
    return out[..., :dv], out[..., dv:], final[..., :dv], final[..., dv:]


def delta_rule_by_state(kernel: Kernel, layout: SequenceLayout, q, k, v, g, beta,
                        output_final_state: bool, kw: dict[str, Any]):
    """The delta rule over the whole sequence by state passing; returns
    (this rank's output, the exact state after its last position or None)."""
    pieces = _split_pieces(layout, [q, k, v, g, beta])
    lengths = {p[0].shape[1] for p in pieces}
    if len(pieces) > 1 and len(lengths) == 1:
        # Equal head-tail pieces: one kernel call, the pieces stacked on the batch.
        stacked = [torch.cat(parts, dim=0) for parts in zip(*pieces)]
        o0, p_t, z, m = _widened_call(kernel, *stacked, kw)
        calls = list(zip(*(t.chunk(len(pieces), dim=0) for t in (o0, p_t, z, m))))
    else:
        calls = [_widened_call(kernel, *parts, kw) for parts in pieces]
    entering = incoming_states(layout, [c[2] for c in calls], [c[3] for c in calls],
                               torch.matmul)
    outs = []
    for (o0, p_t, _, _), s_in in zip(calls, entering):
        carried = torch.einsum("blhk,bhkv->blhv", p_t.to(s_in.dtype), s_in)
        outs.append(o0 + carried.to(o0.dtype))
    final = None
    if output_final_state:
        _, _, z, m = calls[-1]
        final = torch.matmul(m, entering[-1]) + z
    return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0], final


def delta_rule_by_heads(kernel: Kernel, layout: SequenceLayout, q, k, v, g, beta,
                        kw: dict[str, Any]) -> torch.Tensor:
    """The delta rule over the whole sequence by head re-sharding; returns
    this rank's output. Needs ``q.shape[2] % world_size == 0``."""
    hk, hv, dv = k.shape[2], v.shape[2], v.shape[-1]
    group = hv // hk  # value heads per key head, kept together on one rank
    # Every stream as (B, L, Hk, width): a key head with its value heads.
    streams = [q, k, v.reshape(*v.shape[:2], hk, group * dv),
               g.reshape(*g.shape[:2], hk, -1), beta.reshape(*beta.shape[:2], hk, group)]
    local = sequence_to_heads(layout, streams)
    ql, kl, vl, gl, bl = local
    b, s, h_local = ql.shape[:3]
    v_heads = h_local * group
    out, _ = kernel(ql, kl, vl.reshape(b, s, v_heads, dv),
                    g=gl.reshape(b, s, v_heads, *g.shape[3:]),
                    beta=bl.reshape(b, s, v_heads), initial_state=None,
                    output_final_state=False, **kw)
    back = heads_to_sequence(layout, out.reshape(b, s, h_local, group * dv))
    return back.reshape(*v.shape)
