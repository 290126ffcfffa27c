"""Key-padding masks under context parallelism.

A mask that depends only on the key position (boolean or additive,
broadcastable to (B, 1, 1, S_k): a text padding mask) becomes one more
coordinate of every query and key: q' = [q, 1], k' = [k, bias / scale]
(v stays: v's head dim may differ from q/k's), so that
scale * q'.k' = scale * q.k + bias. The bias then
travels with its K/V block around the ring and is exchanged with the keys by
Ulysses, and every kernel, mask and schedule of the ring stays as it is.
Masked keys get a finite bias of -120 (-1e4 in float64), not -inf: a zero
probability times -inf is NaN in the backward, and the ring's merge of a
block whose keys are all masked must stay exact (its log-sum-exp then sits
about 120 below the row's, where float32 still resolves the difference to
within a rounding, while exp(-120) is below float32's resolution).
Any other mask shape raises NotImplementedError naming it.
"""

from __future__ import annotations

import math

import torch

__all__ = ["bias_columns", "check_key_padding", "key_padding_inputs"]

# CUDA's fused kernels take head dims in multiples of this.
_CUDA_HEAD_DIM_ALIGN = 8


def check_key_padding(op: str, attn_mask, k: torch.Tensor) -> tuple[int, ...]:
    """``attn_mask``'s shape as 4 dims; NotImplementedError naming the shape
    unless it depends on the key position alone, or when the mask requires
    grad; ValueError for a dtype that is neither boolean nor floating point."""
    if not isinstance(attn_mask, torch.Tensor):
        raise ValueError(f"cplib.{op}: attn_mask must be a tensor, got "
                         f"{type(attn_mask).__name__}")
    shape = tuple(attn_mask.shape)
    b, lk = k.shape[0], k.shape[2]
    full = (1,) * (4 - len(shape)) + shape
    if len(shape) > 4 or full[1] != 1 or full[2] != 1 or full[0] not in (1, b) \
            or full[3] not in (1, lk):
        raise NotImplementedError(
            f"cplib.{op}: context-parallel attention takes only key-padding masks, which "
            f"depend on the key position alone (broadcastable to (B, 1, 1, S_k) = ({b}, 1, 1, "
            f"{lk}) for these shards); attn_mask (got {shape}) is not one")
    if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
        raise ValueError(f"cplib.{op}: attn_mask must be boolean or floating point, got "
                         f"{attn_mask.dtype}")
    if attn_mask.requires_grad:  # the bias enters detached: its gradient would be lost
        raise NotImplementedError(
            f"cplib.{op}: attn_mask requires grad, but context-parallel attention takes the "
            "key-padding mask as a constant and computes no gradient for it; pass "
            "attn_mask.detach(), or give the bias to the keys another way")
    return full


def _bias(op: str, attn_mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
          scale: float) -> torch.Tensor:
    """The mask as a (B, 1, S_k, 1) coordinate of k (bias / scale), in k's dtype."""
    full = check_key_padding(op, attn_mask, k)
    b, lk = k.shape[0], k.shape[2]
    mask = attn_mask.reshape(full).expand(b, 1, 1, lk).reshape(b, 1, lk, 1)
    masked = -1e4 if k.dtype == torch.float64 else -120.0
    if mask.dtype == torch.bool:
        bias = torch.zeros(mask.shape, dtype=k.dtype, device=k.device)
        bias = bias.masked_fill(~mask, masked)
    else:
        bias = mask.detach().to(k.dtype).clamp(min=masked)
    return bias / scale


def bias_columns(head_dim: int, device_type: str) -> int:
    """Columns added to q and k (the first carries the bias, the rest are
    zeros): one, or on CUDA as many as take the head dim to the next
    multiple of 8 (at least one), so that the fused kernels take it."""
    if device_type != "cuda":
        return 1
    return _CUDA_HEAD_DIM_ALIGN - head_dim % _CUDA_HEAD_DIM_ALIGN


def key_padding_inputs(op: str, attn_mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, scale: float | None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, int]:
    """(q', k', v', scale, D_v): inputs of an unmasked attention op whose
    output, sliced to its first D_v columns, is the masked attention of q, k,
    v; differentiable in q, k and v."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    bias = _bias(op, attn_mask, q, k, scale)
    extra = bias_columns(q.shape[-1], q.device.type)
    qb, hq, lq = q.shape[:3]
    kb, hkv, lk = k.shape[:3]
    q_tail = torch.zeros(qb, hq, lq, extra, dtype=q.dtype, device=q.device)
    q_tail[..., 0] = 1
    k_tail = torch.zeros(kb, hkv, lk, extra, dtype=k.dtype, device=k.device)
    k_tail[..., :1] = bias.expand(kb, hkv, lk, 1)
    return torch.cat([q, q_tail], -1), torch.cat([k, k_tail], -1), v, scale, v.shape[-1]
