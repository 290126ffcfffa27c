"""Query rows that see no key, as transformers' eager attention computes them.

Left padding leaves its query rows nothing to attend to (every key they may
see, causally, is padding). transformers' eager path adds the dtype's lowest
value to every masked score; in such a row that value swallows the scores,
so the softmax is uniform: the row's output is the mean of the values over
all ``kv_length`` keys, and its gradient is the softmax's at that uniform
distribution (q and k get one). With sinks (gpt-oss) the sink's logit wins
instead: the output is 0, with no gradient. These rows
matter: the labels HF's collator makes score the last pad against the
first token. ``attn_implementation="cplib"`` gives them that value in one
process and under context parallelism alike; a rank finds its rows from
the padding of the whole sequence (one all-gather of the 2-D mask per mask
transformers builds, in ``cplib_mask``) and their values and gradients from
a few small sums over every rank (_UniformRows).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ...frontend.sequence import SequenceShards

__all__ = ["UNPADDED", "dead_rows_of", "dead_rows_under_cp", "eager_dead_rows"]

# The attribute cplib_mask sets on the mask it returns under context
# parallelism: (the layout, every key's "not padding" over the whole
# sequence, (B, S) in global order).
UNPADDED = "_cplib_unpadded"


def dead_rows_of(see: torch.Tensor) -> torch.Tensor:
    """(B or 1, q): the rows of a (B or 1, 1, q, kv) visibility mask that see nothing."""
    return ~see.any(-1)[:, 0]


def _bounds(pos: torch.Tensor, seq_len: int, causal: bool, window: Any,
            cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """[lo, hi]: the global keys query ``pos`` may see before padding."""
    left = seq_len if window is None or window[0] is None else window[0]
    right = 0 if causal else seq_len if window is None or window[1] is None else window[1]
    lo, hi = (pos - left).clamp(min=0), (pos + right).clamp(max=seq_len - 1)
    if cu_seqlens is not None:
        cu = cu_seqlens.to(pos.device)
        doc = torch.searchsorted(cu, pos, right=True)
        lo, hi = torch.maximum(lo, cu[doc - 1]), torch.minimum(hi, cu[doc] - 1)
    return lo, hi


def dead_rows_under_cp(shards: SequenceShards, unpadded: torch.Tensor, causal: bool,
                       window: Any, cu_seqlens: torch.Tensor | None
                       ) -> tuple[torch.Tensor, bool]:
    """(this rank's query rows that see nothing, (B, Lq) in local order;
    whether any row of the whole sequence does, the same on every rank)."""
    seq_len = unpadded.shape[-1]
    every = torch.arange(seq_len, device=unpadded.device)
    lo, hi = _bounds(every, seq_len, causal, window, cu_seqlens)
    counts = torch.nn.functional.pad(unpadded.long().cumsum(-1), (1, 0))  # (B, S + 1)
    dead = counts[:, hi + 1] - counts[:, lo] == 0  # (B, S), global order
    return shards.local(dead), bool(dead.any())


def _all_reduce(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(t, group=group)
    return t


class _UniformRows(torch.autograd.Function):
    """Eager attention of the rows that see nothing: the softmax is uniform
    over all S keys (the masked scores' constant swallows them) and its
    gradient is the softmax's at that distribution. With v̄ the mean value,
    for such a row i (of query head h over K/V head g(h)) and every key j:

        out_i = v̄,  dq_i = scale/S * ((sum_j k_j v_j^T) dO_i - (dO_i . v̄) sum_j k_j),
        dk_j = scale/S * ((sum_i q_i dO_i^T) v_j - sum_i (dO_i . v̄) q_i),  dv_j = sum_i dO_i / S,

    the sums over every rank of ``group`` (None: this process alone): one
    all-reduce of the values' sum forward, one of four small sums backward."""

    @staticmethod
    def forward(ctx, q, k, v, dead, scale: float, seq_len: int, group):
        vbar = _all_reduce(v.sum(2, dtype=torch.float32), group) / seq_len  # (B, Hkv, Dv)
        ctx.save_for_backward(q, k, v, dead, vbar)
        ctx.scale, ctx.seq_len, ctx.group = scale, seq_len, group
        groups = q.shape[1] // k.shape[1]
        out = vbar.repeat_interleave(groups, 1)[:, :, None, :]
        return out.to(v.dtype).expand(q.shape[0], q.shape[1], q.shape[2], v.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        q, k, v, dead, vbar = ctx.saved_tensors
        b, hkv, lq = k.shape[0], k.shape[1], q.shape[2]
        groups = q.shape[1] // hkv
        f32 = torch.float32
        qg = q.to(f32).reshape(b, hkv, groups, lq, q.shape[-1])
        dog = (grad.to(f32) * dead[:, None, :, None]).reshape(b, hkv, groups, lq, v.shape[-1])
        kf, vf = k.to(f32), v.to(f32)
        along = torch.einsum("bhgie,bhe->bhgi", dog, vbar)  # dO_i . v̄
        sums = [torch.einsum("bhjd,bhje->bhde", kf, vf), kf.sum(2),
                torch.einsum("bhgid,bhgie->bhde", qg, dog),
                torch.einsum("bhgi,bhgid->bhd", along, qg), dog.sum((2, 3))]
        flat = _all_reduce(torch.cat([t.flatten(1) for t in sums], 1), ctx.group)
        kv, ksum, qdo, aq, dosum = (part.view_as(t) for part, t in zip(
            flat.split([t[0].numel() for t in sums], 1), sums))
        c = ctx.scale / ctx.seq_len
        dq = c * (torch.einsum("bhde,bhgie->bhgid", kv, dog)
                  - along[..., None] * ksum[:, :, None, None])
        dk = c * (torch.einsum("bhde,bhje->bhjd", qdo, vf) - aq[:, :, None, :])
        dv = (dosum / ctx.seq_len)[:, :, None, :].expand_as(vf)
        return (dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None,
                None, None)


def eager_dead_rows(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    dead: torch.Tensor, scale: float | None, seq_len: int, group: Any,
                    sinks: Any) -> torch.Tensor:
    """``out`` (B, Hq, Lq, Dv) with the rows ``dead`` (B, Lq) as eager
    attention computes them over the ``seq_len`` keys of ``group``'s ranks
    (this process's ``k``, ``v`` alone: None). Under context parallelism every
    rank calls it, whether it holds such a row or not. With sinks, eager
    gives those rows 0 and no gradient."""
    dead = dead.expand(q.shape[0], q.shape[2])
    if sinks is not None:
        return out.masked_fill(dead[:, None, :, None], 0)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    rows = _UniformRows.apply(q, k, v, dead.to(q.dtype), scale, seq_len, group)
    return torch.where(dead[:, None, :, None], rows.to(out.dtype), out)
