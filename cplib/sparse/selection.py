"""What a sparse indexer may choose and what it chose, in global positions.

* :func:`visible`: which keys a query may see (causal in global positions,
  the keys' validity: padding, and packed documents), for the indexer's
  scores and for the attention;
* :func:`query_block`: how many queries the indexer scores at once, so that
  a rank never holds more floats of a block than its queries times the
  sequence;
* :func:`attended`: the keys this rank's queries attend (the union of their
  selections, sorted) and the mask of each query over them.
"""

from __future__ import annotations

import torch

__all__ = ["visible", "query_block", "attended"]


def _documents(pos: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor | None:
    if cu_seqlens is None:
        return None
    return torch.searchsorted(cu_seqlens.to(pos.device), pos, right=True)


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, key_valid: torch.Tensor | None = None,
            cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """(B or 1, Lq, Lk) bool: key j visible from query i (``k_pos[j] <=
    q_pos[i]``, in one document of ``cu_seqlens``, and ``key_valid[b, j]``
    where given, (B, Lk))."""
    see = k_pos[None, None, :] <= q_pos[None, :, None]
    qd, kd = _documents(q_pos, cu_seqlens), _documents(k_pos, cu_seqlens)
    if qd is not None:
        see = see & (kd[None, None, :] == qd[None, :, None])
    if key_valid is not None:
        see = see & key_valid[:, None, :].bool()
    return see


def query_block(rows: int, width: int) -> int:
    """Queries scored at once by an indexer that holds ``width`` x S floats
    per query (its per-head scores, heads x S; and, where its matmul
    broadcasts the keys to every query, head_dim x S): a block's stay
    within ``rows`` x S, this rank's queries against the whole sequence
    (one query at least)."""
    return max(1, rows // max(1, width))


def attended(topk: torch.Tensor, q_pos: torch.Tensor, key_valid: torch.Tensor | None = None,
             cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, mask): the sorted global positions that any query attends, and
    (B, Lq, len(keys)) bool, query i attending key j. ``topk`` (B, Lq, K)
    holds the selected global positions (-1: none); a selection is attended
    where :func:`visible` allows it (a row with fewer than K visible keys
    selects some it cannot see)."""
    sel = topk.long()
    ok = sel >= 0
    safe = sel.clamp(min=0)
    ok &= safe <= q_pos[None, :, None]
    qd, kd = _documents(q_pos, cu_seqlens), _documents(safe, cu_seqlens)
    if qd is not None:
        ok &= kd == qd[None, :, None]
    if key_valid is not None:
        valid = key_valid.bool().expand(sel.shape[0], -1)
        ok &= valid.gather(1, safe.flatten(1)).view_as(safe)
    keys = torch.unique(safe[ok])
    slot = torch.searchsorted(keys, safe)
    slot = torch.where(ok, slot, keys.numel())  # one spare column for what is not attended
    mask = torch.zeros((*sel.shape[:2], keys.numel() + 1), dtype=torch.bool, device=sel.device)
    mask.scatter_(2, slot, True)
    return keys, mask[..., :-1]
