"""Attention of a rank's queries over a set of keys with a boolean mask (the
keys a sparse indexer selected), memory-light: queries in blocks, and the
backward recomputes each block's probabilities instead of keeping them
(what a fused kernel keeps: the output and the log-sum-exp per row).

Exact math, as transformers' eager path computes it: logits ``scale * q.k``,
masked keys out, an optional sink per head joining each row's softmax
denominator once (gpt-oss, HY-v4), ``softmax @ v``. q/k and v may have
different head dims (MLA). A row that sees no key gives zeros (no NaN).
"""

from __future__ import annotations

import torch

__all__ = ["masked_attention"]

# Logits held at once per block: (batch x heads x block rows x keys).
_BLOCK_LOGITS = 1 << 24


def _rows_per_block(b: int, h: int, keys: int, rows: int) -> int:
    return max(1, min(rows, _BLOCK_LOGITS // max(1, b * h * keys)))


def _acc(t: torch.Tensor) -> torch.dtype:
    """The softmax's dtype: float32 for half inputs (as HF's eager path),
    float64 for float64."""
    return torch.promote_types(t.dtype, torch.float32)


def _logits(q, k, mask, scale):
    s = torch.matmul(q, k.transpose(-1, -2)).to(_acc(q)) * scale
    return s.masked_fill(~mask[:, None], float("-inf"))


def _lse(s, sinks):
    lse = torch.logsumexp(s, -1)
    if sinks is not None:
        lse = torch.logaddexp(lse, sinks.to(lse.dtype).view(1, -1, 1))
    # A row that sees nothing (and has no sink): probabilities 0, not NaN.
    return lse.masked_fill(torch.isneginf(lse), 0.0)


class _MaskedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, sinks, scale):
        b, h, rows, _ = q.shape
        step = _rows_per_block(b, h, k.shape[2], rows)
        out = q.new_empty((b, h, rows, v.shape[-1]))
        lse = torch.empty((b, h, rows), dtype=_acc(q), device=q.device)
        for a in range(0, rows, step):
            s = _logits(q[:, :, a:a + step], k, mask[:, a:a + step], scale)
            lse[:, :, a:a + step] = _lse(s, sinks)
            p = torch.exp(s - lse[:, :, a:a + step, None])
            out[:, :, a:a + step] = torch.matmul(p.to(v.dtype), v)
        ctx.save_for_backward(q, k, v, mask, sinks, out, lse)
        ctx.scale, ctx.step = scale, step
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, mask, sinks, out, lse = ctx.saved_tensors
        scale, step = ctx.scale, ctx.step
        acc = _acc(q)
        dq = torch.empty_like(q)
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        dsinks = None if sinks is None else torch.zeros(sinks.shape, dtype=acc,
                                                        device=sinks.device)
        for a in range(0, q.shape[2], step):
            sl = slice(a, a + step)
            p = torch.exp(_logits(q[:, :, sl], k, mask[:, sl], scale) - lse[:, :, sl, None])
            do = grad[:, :, sl].to(acc)
            dv += torch.matmul(p.transpose(-1, -2), do)
            delta = (do * out[:, :, sl].to(acc)).sum(-1)  # rowsum(dO * O)
            ds = p * (torch.matmul(do, v.to(acc).transpose(-1, -2)) - delta[..., None])
            dq[:, :, sl] = (torch.matmul(ds, k.to(acc)) * scale).to(q.dtype)
            dk += torch.matmul(ds.transpose(-1, -2), q[:, :, sl].to(acc)) * scale
            if dsinks is not None:
                # d lse / d sink = exp(sink - lse); out moves with lse alone.
                w = torch.exp(sinks.to(acc).view(1, -1, 1) - lse[:, :, sl])
                dsinks -= (w * delta).sum((0, 2))
        dsinks = None if dsinks is None else dsinks.to(sinks.dtype)
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, dsinks, None


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax(scale * q k^T, masked) v``: q (B, H, L, D), k (B, H or a
    divisor, U, D), v (B, like k, U, Dv), ``mask`` (B or 1, L, U) bool, True
    where a query attends a key; ``sinks`` (H,) one logit per head. Returns
    (B, H, L, Dv); differentiable in q, k, v and sinks."""
    if mask.dtype != torch.bool or mask.dim() != 3:
        raise ValueError(f"cplib.sparse.masked_attention: mask must be a (B, L, U) bool "
                         f"tensor, got {tuple(mask.shape)} {mask.dtype}")
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # expanded for the math; autograd sums the groups back
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    mask = mask.expand(q.shape[0], q.shape[2], k.shape[2])
    return _MaskedAttention.apply(q, k, v, mask, sinks, scale)
