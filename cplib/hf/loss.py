"""The causal-LM loss of Hugging Face models under ``cplib.context_parallel``.

HF's ``ForCausalLMLoss`` shifts ``labels`` by one inside the tensor it gets
and averages over the valid tokens it sees. Under context parallelism a rank
holds a shard of the sequence (in the context's layout: head-tail, the
document placement, ...), so the shift inside a shard pairs a token with
whichever token follows it in the shard, and the mean is over that rank's
valid tokens only. Inside a ``cplib.context_parallel`` region this module's
loss instead

* shifts the labels over the whole sequence (``labels`` listed among the
  context's buffers is gathered back first, one small all-gather of
  integers; full-length ``labels`` are used as they are; ``shift_labels``,
  already shifted, are taken as given), and takes this rank's shard of them
  in the context's layout, so that every logit meets the label one process
  would give it (documents included: HF pairs the last token of a document
  with the first of the next, as one process does);
* returns ``N * (sum of this rank's token losses) / (global count of valid
  labels)`` (or ``num_items_in_batch`` when given), so that the mean over the
  N context-parallel ranks of the returned loss is the single-process loss,
  and the mean of their parameter gradients is the single-process gradient
  (what FSDP's mean over a mesh that folds in the CP ranks computes), also
  when ``-100`` labels fall unevenly on the ranks.

Outside any context the loss is HF's own. ``import cplib.hf`` installs it for
every loss type HF maps to ``ForCausalLMLoss``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.overrides import _get_current_function_mode_stack

__all__ = ["install_causal_lm_loss", "context_parallel_causal_lm_loss"]


def _active_handle() -> Any:
    """The ContextParallelHandle of the innermost cplib.context_parallel region."""
    from ..frontend.sdpa_dispatch import CPDispatchMode

    for mode in reversed(_get_current_function_mode_stack()):
        if isinstance(mode, CPDispatchMode) and mode.handle is not None:
            return mode.handle
    return None


def _full_sequence(handle: Any, t: torch.Tensor, what: str, local_len: int,
                   seq_len: int) -> torch.Tensor:
    """``t`` over the whole sequence: gathered when it is this rank's shard."""
    if t.shape[-1] == local_len and local_len != seq_len:
        (full,) = handle.unshard([t], [t.dim() - 1])
        return full
    if t.shape[-1] == seq_len:
        return t
    raise ValueError(
        f"cplib: {what} has {t.shape[-1]} positions, but under cplib.context_parallel this "
        f"rank's logits have {local_len} and the sequence {seq_len}: list {what} among the "
        "context's buffers (seq dim 1, like input_ids), or pass the full, unsharded tensor")


def _local_shard(handle: Any, full: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a full (B, S) tensor in the context's layout."""
    from ..frontend.sharding import shard_tensor
    from ..ring.load_balancer import shard_lengths

    mesh, balancer = handle.mesh, handle.load_balancer
    n, rank = mesh.size(), mesh.get_local_rank()
    indices = None if balancer is None else balancer._generate_indices()
    lengths = shard_lengths(full.shape[-1], n, balancer)
    return shard_tensor(full, full.dim() - 1, rank, n, indices, lengths)


def context_parallel_causal_lm_loss(original: Callable[..., torch.Tensor], logits: torch.Tensor,
                                    labels: torch.Tensor | None, vocab_size: int,
                                    num_items_in_batch: Any = None, ignore_index: int = -100,
                                    shift_labels: torch.Tensor | None = None,
                                    **kwargs: Any) -> torch.Tensor:
    """HF's causal-LM loss (``original``) outside a context; inside one, the
    loss of the module docstring."""
    handle = _active_handle()
    if handle is None:
        return original(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                        ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
    config = handle.config
    local_len = logits.shape[-2]
    seq_len = config.seq_len
    if seq_len is None:  # equal shards
        seq_len = local_len * handle.mesh.size()
    if shift_labels is None:
        full = _full_sequence(handle, labels, "labels", local_len, seq_len)
        shifted = F.pad(full[..., 1:], (0, 1), value=ignore_index)
    else:
        shifted = _full_sequence(handle, shift_labels, "shift_labels", local_len, seq_len)
    count = (shifted != ignore_index).sum()
    local = _local_shard(handle, shifted).to(logits.device)
    total = F.cross_entropy(logits.float().reshape(-1, vocab_size), local.reshape(-1),
                            ignore_index=ignore_index, reduction="sum")
    denominator = num_items_in_batch if num_items_in_batch is not None else count
    if torch.is_tensor(denominator):
        denominator = denominator.to(total.device)
    return total * handle.mesh.size() / denominator


def install_causal_lm_loss() -> None:
    """Routes every HF loss type mapped to ``ForCausalLMLoss`` through
    :func:`context_parallel_causal_lm_loss` (idempotent)."""
    from transformers.loss import loss_utils

    original = loss_utils.ForCausalLMLoss
    wrapped = functools.wraps(original)(functools.partial(context_parallel_causal_lm_loss,
                                                          original))
    wrapped.__cplib_wraps__ = original  # type: ignore[attr-defined]
    for key, fn in list(loss_utils.LOSS_MAPPING.items()):
        if fn is original:
            loss_utils.LOSS_MAPPING[key] = wrapped

