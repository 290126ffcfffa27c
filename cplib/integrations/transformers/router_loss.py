"""Mixture-of-experts routers' load-balancing loss under context parallelism.

Hugging Face's ``load_balancing_loss_func`` (Mixtral, Qwen2/3-MoE and the
other MoE decoders) is ``E * sum_e f_e * P_e``: the fraction of tokens routed
to expert e times its mean router probability, both means over every token.
Computed on one rank's shard, each mean is over that shard only, and the
mean over the ranks of the products is not the product of the means. Under
context parallelism this module gathers every layer's router logits over the
context-parallel group (rows padded to the longest shard, the padding masked
out) and runs Hugging Face's own function on all the tokens: every rank gets
the one-process value. The gather's backward sums the ranks' gradients and
hands each rank those of its rows, so the mean over the ranks of the
parameter gradients is the one-process gradient.
"""

from __future__ import annotations

import contextvars
from typing import Any, Callable

import torch
import torch.distributed as dist

from ...comm.handshake import agreed
from ...comm.native import check_mesh
from ...frontend.sequence import active_handle, layout_in_scope

__all__ = ["context_parallel_router_loss", "caller_scales"]

# Whether the causal-LM loss of the forward being computed was given
# num_items_in_batch: Hugging Face's sign that the caller scales the loss by
# its number of processes (Trainer does), so the router loss, added to it in
# the same forward, must leave that factor to the caller too. Set by
# losses.py, which runs first in every MoE forward with labels.
caller_scales: contextvars.ContextVar[bool] = contextvars.ContextVar("cplib_caller_scales",
                                                                      default=False)


class _GatherRows(torch.autograd.Function):
    """Every rank's (rows, E) tensor, padded to ``longest`` rows, in rank
    order; the backward sums the gradient over the ranks (each rank's loss
    read every rank's rows) and keeps this rank's rows."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group: dist.ProcessGroup, longest: int) -> torch.Tensor:
        ctx.group, ctx.rows = group, t.shape[0]
        padded = torch.cat([t, t.new_zeros(longest - t.shape[0], *t.shape[1:])])
        parts = [torch.empty_like(padded) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        longest = grad.shape[0] // dist.get_world_size(ctx.group)
        start = dist.get_rank(ctx.group) * longest
        return grad[start:start + ctx.rows], None, None


def _cp_mesh() -> Any:
    """The mesh of the scope in effect (a region, or a model's forward given
    shards: cplib/frontend/sequence.py); None outside context parallelism."""
    handle = active_handle()
    if handle is not None:
        return handle.mesh
    shards = layout_in_scope()
    return None if shards is None else shards.mesh


def _row_mask(rows: list[int], longest: int, mask: torch.Tensor | None,
              group: dist.ProcessGroup, like: torch.Tensor) -> torch.Tensor:
    """(1, N * longest): the attention mask of every rank's rows (1 where
    none was given), 0 on the padding."""
    mine = torch.zeros(longest, dtype=torch.float32, device=like.device)
    mine[:rows[dist.get_rank(group)]] = 1.0 if mask is None else mask.reshape(-1).float()
    parts = [torch.empty_like(mine) for _ in rows]
    dist.all_gather(parts, mine, group=group)
    return torch.cat(parts).unsqueeze(0)


def context_parallel_router_loss(original: Callable[..., Any], gate_logits: Any,
                                 num_experts: int | None = None, top_k: int = 2,
                                 attention_mask: torch.Tensor | None = None) -> Any:
    """``original`` (a ``load_balancing_loss_func``) over every token of the
    sequence under context parallelism, else as it is."""
    mesh = _cp_mesh()
    if mesh is None or not isinstance(gate_logits, tuple) or not gate_logits:
        return original(gate_logits, num_experts, top_k, attention_mask)
    group = check_mesh(mesh)
    local = gate_logits[0].shape[0]

    def check() -> None:
        if any(g.shape[0] != local for g in gate_logits):
            raise ValueError("cplib: the router logits of the layers have different numbers "
                             f"of rows: {[g.shape[0] for g in gate_logits]}")
        if attention_mask is not None and attention_mask.numel() != local:
            raise ValueError(
                f"cplib: the router loss got an attention_mask of shape "
                f"{tuple(attention_mask.shape)} for {local} routed tokens on this rank: list "
                "the 2-D attention_mask among the context's buffers (seq dim 1)")

    agreed("load_balancing_loss_func", group.group_name, list(gate_logits), check)
    counts = torch.tensor([local], device=gate_logits[0].device)
    every = [torch.empty_like(counts) for _ in range(mesh.size())]
    dist.all_gather(every, counts, group=group)
    rows = [int(c.item()) for c in every]
    longest = max(rows)
    gathered = tuple(_GatherRows.apply(g, group, longest) for g in gate_logits)
    mask = None
    if attention_mask is not None or len(set(rows)) > 1:
        mask = _row_mask(rows, longest, attention_mask, group, gate_logits[0])
    loss = original(gathered, num_experts, top_k, mask)
    # The caller multiplies by its number of processes (Trainer): leave it that
    # factor. Read once: a later forward without a causal-LM loss is not scaled.
    scaled = caller_scales.get()
    caller_scales.set(False)
    return loss / mesh.size() if scaled else loss
