"""Causal-LM cross-entropy under context parallelism, for a loss of your own:
``cplib.loss.cross_entropy(logits, labels)``.

A rank holds its shard of the sequence (head-tail, sequential, per document,
the document placement, ...), so shifting labels inside the shard pairs a
token with whatever follows it in the shard, and a mean over the rank's own
valid tokens is not the mean over the sequence. This loss shifts the labels
over the whole sequence and normalises by the global count of valid tokens,
in the layout in effect (the ``cplib.context_parallel`` region's, or the last
``_context_parallel_shard``'s: cplib/frontend/sequence.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .frontend.sequence import SequenceShards, labels_in_layout

__all__ = ["cross_entropy", "shifted", "token_loss_sum"]


def shifted(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Each position's next token (the last position gets ``ignore_index``),
    on a whole sequence, as Hugging Face's causal-LM loss shifts."""
    return F.pad(labels[..., 1:], (0, 1), value=ignore_index)


def token_loss_sum(shards: SequenceShards | None, logits: torch.Tensor, target: torch.Tensor,
                   ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """(the summed cross-entropy of this rank's logits against its shard of
    ``target``, a whole-sequence tensor; the global count of valid targets)."""
    count = (target != ignore_index).sum()
    local = target if shards is None else shards.local(target)
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                            local.reshape(-1).to(logits.device), ignore_index=ignore_index,
                            reduction="sum")
    return total, count.to(total.device)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, *, shift: bool = True,
                  ignore_index: int = -100) -> torch.Tensor:
    """The mean next-token cross-entropy of a sequence sharded over the
    context-parallel ranks, as each rank's share: the mean over the CP ranks
    of the returned loss, and of the parameter gradients, is the
    single-process value (``N * this rank's token losses / global count``).

    ``logits`` (..., S_local, V) are this rank's; ``labels`` (..., S_local)
    this rank's shard, cut with the inputs (a buffer of the
    ``cplib.context_parallel`` region, or sharded by the same
    ``_context_parallel_shard`` call), or the whole (..., S). ``shift=True``
    (Hugging Face's labels, the input ids with ``ignore_index`` where no loss
    is wanted): position i is scored against label i + 1 of the whole
    sequence, across shard borders; ``shift=False``: labels already shifted
    (torchtitan's). Outside context parallelism it is the plain mean.

    Labels of another length, or sharded by cplib in another layout, raise
    ValueError on every rank before any collective.
    """
    shards, full = labels_in_layout(logits, labels)
    target = shifted(full, ignore_index) if shift else full
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    total, count = token_loss_sum(shards, logits, target, ignore_index)
    n = 1 if shards is None else shards.mesh.size()
    return total * n / count
