"""Hugging Face attention paths that context parallelism cannot shard,
refused by name instead of computing something else.

Under context parallelism (a ``cplib.context_parallel`` region, or a module
parallelized with ``_ContextParallel``) every SDPA call runs over the whole
sequence, but two of transformers' attention paths would give another
result without a word:

* eager attention (``attn_implementation="eager"``, each model's
  ``eager_attention_forward``; ``"paged|eager"``), the flash-attn kernels
  (``"flash_attention_2"``, ...) and flex attention (``"flex_attention"``,
  unless a module parallelized with ``_ContextParallel(attention_type=FLEX)``
  takes its calls over) attend from this rank's queries to this rank's keys
  only;
* a sliding-window layer on SDPA: transformers builds its window mask from
  the shard's length and skips it (``is_causal=True``) when the shard is no
  longer than the window, so a window shorter than the whole sequence is
  lost (a longer shard gets a 4-D mask, which the ring refuses anyway);
* packed documents in ``position_ids`` (where transformers looks for them:
  no 2-D mask, no cache) in a context given no documents: transformers sees
  this rank's positions only, so a document that starts at a shard border
  goes unseen and attention runs across it (whatever the implementation);
* no ``position_ids`` at all: transformers numbers each shard from 0, so
  the rotary positions of every rank past the first are another sequence's
  (with or without documents given to the context).

Every model's attention layer looks its function up through
``AttentionInterface.get_interface`` when it runs; the guard wraps that
lookup. Outside context parallelism it returns what transformers returns.
Under it, the first two raise NotImplementedError naming the implementation
(or the window and the sequence length) and what to use instead; the
condition reads the config and shapes only, the same on every rank, and
comes before any collective. For the third, the guard wraps
``masking_utils.find_packed_sequence_indices``: the ranks reduce one pair of
integers (whether every position is its global row index plus one common
offset) and raise together where it is not. Where transformers does not
look (a 2-D mask, or a cache: the default of a training forward), the guard
wraps ``masking_utils._preprocess_mask_arguments``, which every mask runs:
one reduce of four integers, raising where every rank's positions count up
by one from one common start (how transformers numbers a shard), unless
they are the positions of the documents given to the context; in a context
given documents that check replaces the third.
``attn_implementation="cplib"`` (``import cplib.hf``) takes windows; any
other registered function runs.
The guard is installed with the rest of the integration (__init__.py).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, NamedTuple

import torch

from torch.overrides import _get_current_function_mode_stack

from ... import patch_registry as registry
from ...flex.cp_mode import FlexCPMode
from ...frontend.sdpa_dispatch import active_config, max_over_cp_ranks
from ...frontend.sequence import SequenceShards, layout_in_scope, sequence_shards
from .models import OWNER
from .sparse import attention_taken_over

__all__ = ["install_attention_guard"]

# transformers' implementations that attend within the local shard only.
_LOCAL_ONLY = ("eager", "paged|eager", "flash_attention_2", "flash_attention_3",
               "flash_attention_4")


def _refuse_local(implementation: str) -> None:
    flex = (", or parallelize the attention modules with _ContextParallel(attention_type="
            "FLEX)" if implementation == "flex_attention" else "")
    raise NotImplementedError(
        f"cplib: attn_implementation={implementation!r} computes attention on this rank's "
        "sequence shard alone under context parallelism (its keys and values never leave "
        "the rank); use attn_implementation=\"sdpa\", or \"cplib\" (import cplib.hf), whose "
        f"attention runs over the whole sequence{flex}")


def _local_only(implementation: str) -> bool:
    if implementation == "flex_attention":  # unless cplib's flex module path takes it over
        return not any(isinstance(m, FlexCPMode) for m in _get_current_function_mode_stack())
    return implementation in _LOCAL_ONLY


def _windowed_sdpa(sdpa: Callable) -> Callable:
    """transformers' SDPA attention, refusing a sliding window shorter than
    the whole sequence under context parallelism."""

    @functools.wraps(sdpa)
    def attention(module: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        window, config = kwargs.get("sliding_window"), active_config()
        if window is not None and config is not None:
            seq_len = config.seq_len or query.shape[-2] * config.world_size
            if seq_len > window:
                raise NotImplementedError(
                    f"cplib: {type(module).__name__} has sliding_window={window}, shorter than "
                    f"the {seq_len}-token sequence under context parallelism, and "
                    "attn_implementation=\"sdpa\" cannot carry it (transformers builds the "
                    "window mask from this rank's shard); use attn_implementation=\"cplib\" "
                    "(import cplib.hf), which runs the window over the whole sequence")
        return sdpa(module, query, *args, **kwargs)

    return attention


class _InEffect(NamedTuple):
    """The context parallelism a mask is built under: the layout, the
    documents given to it, and the max over its ranks."""

    shards: SequenceShards
    cu_seqlens: torch.Tensor | None
    reduce_max: Callable[[torch.Tensor], None]


def _in_effect(local_len: int) -> _InEffect | None:
    """A region's or a ``_ContextParallel`` module's dispatch, or the
    module-path scope of a model given shards (transformers builds the masks
    before its attention modules run); None outside context parallelism."""
    config = active_config()
    if config is not None:
        shards = sequence_shards(local_len)
        return None if shards is None else \
            _InEffect(shards, config.cu_seqlens, lambda t: max_over_cp_ranks(t, config))
    shards = layout_in_scope()
    if shards is None:
        return None
    return _InEffect(shards, None, lambda t: torch.distributed.all_reduce(
        t, op=torch.distributed.ReduceOp.MAX, group=shards.group))


def _check_unpacked(position_ids: torch.Tensor, cp: _InEffect) -> None:
    """NotImplementedError on every CP rank unless ``position_ids`` are the
    global row indices of this rank's rows plus one offset common to all
    ranks (no document starts anywhere in the whole sequence)."""
    shards = cp.shards
    rows = shards.local(torch.arange(shards.seq_len, device=position_ids.device))
    if rows.shape[-1] != position_ids.shape[-1]:
        return
    offset = position_ids.long() - rows
    spread = torch.stack([offset.max(), -offset.min()])  # max == min over all ranks: no start
    cp.reduce_max(spread)
    if int(spread[0]) != -int(spread[1]):
        raise NotImplementedError(
            "cplib: position_ids do not count up by one over the whole "
            f"{shards.seq_len}-token sequence: packed documents, but {shards.source} was "
            "given none, and transformers, which finds them in position_ids, sees only this "
            "rank's shard, so attention would run across documents; pass position_ids= (or "
            "cu_seqlens=) to cplib.context_parallel, with attn_implementation=\"cplib\" "
            "(import cplib.hf). (Or the model was not given position_ids: transformers then "
            "numbers each shard from 0; list them among the buffers and pass them.)")


def _document_positions(cu_seqlens: torch.Tensor, seq_len: int,
                        device: torch.device) -> torch.Tensor:
    """Each position's index within its document, over the whole sequence."""
    rows = torch.arange(seq_len, device=device)
    cu = cu_seqlens.to(device)
    return rows - cu[torch.searchsorted(cu, rows, right=True) - 1]


def _check_numbered_globally(position_ids: torch.Tensor, cp: _InEffect) -> None:
    """NotImplementedError on every CP rank when every rank's
    ``position_ids`` count up by one from one common start over its own
    shard: what transformers makes for a model given none (an arange over the
    shard, after the cached tokens). Positions over the whole sequence never
    look like that on two ranks, unless documents given to the context each
    fill a shard: then the documents' own positions do, and are let through."""
    shards = cp.shards
    if shards.mesh.size() == 1:
        return
    local = position_ids.long()
    start = local[..., :1]
    steps = torch.arange(local.shape[-1], device=local.device)
    counts_up = ((local - start) == steps).all()
    not_the_documents = torch.ones((), dtype=torch.long, device=local.device)
    if cp.cu_seqlens is not None:
        mine = shards.local(_document_positions(cp.cu_seqlens, shards.seq_len, local.device))
        if mine.shape[-1] == local.shape[-1]:
            not_the_documents = (mine != local).any().long()
    # [not counting up, max start, -min start, not the documents' positions]: max over ranks.
    seen = torch.stack([(~counts_up).long(), start.max(), -start.min(), not_the_documents])
    cp.reduce_max(seen)
    if int(seen[0]) == 0 and int(seen[1]) == -int(seen[2]) and int(seen[3]) == 1:
        raise NotImplementedError(
            f"cplib: every rank's position_ids count {int(seen[1])}, {int(seen[1]) + 1}, ... "
            f"over its own shard of the {shards.seq_len}-token sequence: transformers numbers "
            "each shard alone when the model is not given position_ids, so its positions "
            f"(rotary embeddings, masks) would be another sequence's; under {shards.source} "
            "pass position_ids over the whole sequence (list them among the buffers)")


def _mask_arguments(preprocess: Callable) -> Callable:
    """transformers' ``_preprocess_mask_arguments`` (run by every mask it
    builds), checking the positions it is given: without a 2-D mask and a
    cache it calls find_packed_sequence_indices, which checks more; with
    either (the default cache of a training forward), nothing else would."""
    signature = inspect.signature(preprocess)

    @functools.wraps(preprocess)
    def preprocess_mask_arguments(*args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():
            given = signature.bind(*args, **kwargs).arguments
            pos, mask = given.get("position_ids"), given.get("attention_mask")
            cp = None if pos is None else _in_effect(pos.shape[-1])
            cache = given.get("past_key_values")
            fresh = cache is None or int(cache.get_seq_length()) == 0
            if cp is not None and fresh and (mask is not None or cache is not None):
                _check_numbered_globally(pos, cp)
        return preprocess(*args, **kwargs)

    return preprocess_mask_arguments


def _packed_search(find: Callable) -> Callable:
    @functools.wraps(find)
    def find_packed_sequence_indices(position_ids: torch.Tensor, *args: Any, **kwargs: Any):
        cp = _in_effect(position_ids.shape[-1])
        if cp is None:
            return find(position_ids, *args, **kwargs)
        if not torch.compiler.is_compiling():
            # _check_unpacked looks for documents the context was not given;
            # given them, what is left to catch is a numbering per shard.
            (_check_unpacked if cp.cu_seqlens is None else _check_numbered_globally)(
                position_ids, cp)
        # Under context parallelism the documents are cplib's: the context's
        # (every attention call takes them) or none (checked above).
        # transformers, seeing one shard, would take a load-balanced shard's
        # jump (0..7, 24..31) or a border for a document start, and build a
        # 4-D mask that the ring refuses.
        return None

    return find_packed_sequence_indices


def _guarded_get_interface(original: Callable) -> Callable:
    @functools.wraps(original)
    def get_interface(self: Any, attn_implementation: str, default: Callable) -> Callable:
        taken = attention_taken_over()  # a sparse layer under CP: its own (sparse/)
        if taken is not None:
            return taken
        fn = original(self, attn_implementation, default)
        if active_config() is None:
            return fn
        if _local_only(attn_implementation):
            _refuse_local(attn_implementation)
        if attn_implementation == "sdpa":
            return _windowed_sdpa(fn)
        return fn

    return get_interface


def install_attention_guard() -> None:
    """Wraps ``AttentionInterface.get_interface`` and transformers' search
    for packed documents (once)."""
    from transformers import masking_utils
    from transformers.modeling_utils import AttentionInterface

    registry.replace(OWNER, masking_utils, "find_packed_sequence_indices", _packed_search)
    preprocess = getattr(masking_utils, "_preprocess_mask_arguments", None)
    if preprocess is not None and {"position_ids", "attention_mask", "past_key_values"} <= set(
            inspect.signature(preprocess).parameters):
        registry.replace(OWNER, masking_utils, "_preprocess_mask_arguments", _mask_arguments)
    registry.replace(OWNER, AttentionInterface, "get_interface", _guarded_get_interface)
