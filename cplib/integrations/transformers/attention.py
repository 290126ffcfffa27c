"""The ``"cplib"`` attention and mask functions for Hugging Face models.

HF's conventions, checked against its eager path: the attention function
gets (B, H, S, D) tensors and returns (B, S, H, Dv); a layer's
``sliding_window=W`` lets query i see key j iff ``0 <= i - j < W`` (causal),
which is cplib's ``window=(W - 1, W - 1)``; ``s_aux`` are gpt-oss sinks;
packed documents are marked by ``position_ids`` that do not step by one.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import torch.nn.functional as F

from .mask_functions import unknown_part
from .sparse.one_process import wants_full_mask, with_selection
from .padding import UNPADDED, dead_rows_of, dead_rows_under_cp, eager_dead_rows
from ...frontend.options import RingConfig
from ...frontend.sequence import sequence_shards
from ...ring.entry import ring_sdpa
from ...frontend.sdpa_dispatch import (active_config, context_extras, max_over_cp_ranks,
                                      sdpa_backend_hint)
from ...ulysses.op import ulysses_sdpa
from ...ulysses.usp import usp_sdpa

__all__ = ["cplib_attention_forward", "cplib_mask"]


def cplib_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0,
               kv_offset: int = 0, mask_function: Any = None,
               attention_mask: torch.Tensor | None = None, **kwargs: Any
               ) -> torch.Tensor | None:
    """The mask for ``attn_implementation="cplib"``: nothing (None) unless the
    2-D padding mask hides a token, then that (B, kv_length) mask itself. The
    attention function derives causal, windows and documents from the layer
    and ``position_ids``, so no (q_length, kv_length) mask is ever built.
    Under context parallelism the ranks agree on it (one flag reduced over
    the group): the ops take the mask as one more q/k coordinate, so every
    rank must pass it as soon as one rank holds padding. A mask function
    with a part of the model's own (mask_functions.py) is never dropped:
    under context parallelism it raises, in one process the layer gets
    eager's mask."""
    unknown = unknown_part(mask_function) or wants_full_mask(kwargs.get("config"))
    if unknown is not None:
        return _eager_mask_of(unknown, batch_size, q_length, kv_length, q_offset, kv_offset,
                              mask_function, attention_mask, **kwargs)
    if attention_mask is None or attention_mask.dim() != 2:
        return None
    padded = torch.tensor([0 if bool(attention_mask.all()) else 1],
                          device=attention_mask.device)
    config = active_config()
    if config is not None:
        max_over_cp_ranks(padded, config)
    if not bool(padded.item()):
        return None
    mask = attention_mask.to(torch.bool, copy=True)  # the attribute below is on cplib's copy
    shards = None if config is None else sequence_shards(kv_length)
    # Every key's padding, for the rows that see none (padding.py); a mask
    # that is not this rank's shard raises in the attention function.
    if shards is not None and mask.shape[-1] == kv_length == shards.local_len():
        setattr(mask, UNPADDED, (shards, shards.full(mask.to(torch.uint8)).bool()))
    return mask


def _eager_mask_of(unknown: str, batch_size: int, q_length: int, kv_length: int,
                   q_offset: int, kv_offset: int, mask_function: Any,
                   attention_mask: torch.Tensor | None, **kwargs: Any) -> torch.Tensor:
    if active_config() is not None:
        config = kwargs.get("config")
        name = type(config).__module__.split(".")[2] if config is not None else "the model"
        raise NotImplementedError(
            f"cplib: {name}'s attention mask holds a part of the model's own ({unknown}), "
            "which cplib's attention does not carry under context parallelism; run it "
            "without context parallelism")
    from transformers.masking_utils import eager_mask

    return eager_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
                      attention_mask, dtype=kwargs.get("dtype", torch.float32),
                      use_vmap=kwargs.get("use_vmap", False), device=kwargs.get("device", "cpu"))


def cplib_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            dropout: float = 0.0, scaling: float | None = None,
                            sliding_window: int | None = None,
                            s_aux: torch.Tensor | None = None, softcap: float | None = None,
                            is_causal: bool | None = None, **kwargs: Any
                            ) -> tuple[torch.Tensor, None]:
    """A Hugging Face attention function (see ``transformers.AttentionInterface``)."""
    if softcap is not None:
        raise NotImplementedError(f"cplib attention: softcap={softcap} (logit soft-capping) is "
                                  "not supported; use attn_implementation='eager'")
    if dropout:
        raise NotImplementedError(f"cplib attention: attention dropout={dropout} is not "
                                  "supported; set the model's attention dropout to 0")
    if kwargs.get("position_bias") is not None:  # would otherwise be ignored: refuse
        raise NotImplementedError("cplib attention: position_bias (an additive bias on the "
                                  "attention logits, e.g. Inkling's relative logits) is not "
                                  "supported; use attn_implementation='eager'")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"cplib attention: sliding_window={sliding_window} must be >= 1")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    # HF's window W sees the W - 1 tokens before each query (and after it,
    # when not causal); causal attention drops the right side.
    window = None if sliding_window is None else (sliding_window - 1, sliding_window - 1)
    config = active_config()
    if config is not None:
        out = _context_parallel(config, query, key, value, attention_mask, scaling, causal,
                                window, s_aux)
    else:
        if kwargs.get("indices") is not None:  # a sparse layer's selection (sparse/one_process.py)
            attention_mask = with_selection(attention_mask, kwargs["indices"], key.shape[2])
        out = _single_device(query, key, value, attention_mask, scaling, causal, window, s_aux,
                             kwargs.get("position_ids"))
    return out.transpose(1, 2).contiguous(), None


# ------------------------------------------------------------ context parallel


def _key_padding(attention_mask, k: torch.Tensor) -> torch.Tensor | None:
    """The mask HF passes under the context as the ops' per-key mask of this
    rank's keys, (B or 1, 1, 1, S_local). ``cplib_mask`` hands on the user's
    2-D (B, S) padding mask, sharded (and load-balance permuted) like the
    keys when it is listed among the context's buffers with seq dim 1."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise NotImplementedError(
            f"cplib attention: attention_mask of type {type(attention_mask).__name__} inside "
            "cplib.context_parallel is not supported; pass a 2-D (batch, seq) padding mask")
    shape = tuple(attention_mask.shape)
    b, lk = k.shape[0], k.shape[2]
    if attention_mask.dim() == 2:
        if shape[0] not in (1, b) or shape[1] != lk:
            raise ValueError(
                f"cplib attention: the 2-D attention_mask (got shape {shape}) must cover this "
                f"rank's ({b}, {lk}) keys; list it among cplib.context_parallel's buffers with "
                "seq dim 1, like input_ids, so that it is sharded like them")
        return attention_mask[:, None, None, :]
    if attention_mask.dim() == 4 and shape[1] == shape[2] == 1 and shape[0] in (1, b) \
            and shape[3] == lk:
        return attention_mask  # already a key-padding mask of the local keys
    raise NotImplementedError(
        f"cplib attention: an attention mask of shape {shape} inside cplib.context_parallel "
        "is not supported: only padding masks, which depend on the key alone (2-D (batch, "
        f"seq) or ({b}, 1, 1, {lk}) for these shards); run outside the context")


def _context_parallel(config: RingConfig, q, k, v, attention_mask, scale, causal, window,
                      sinks) -> torch.Tensor:
    out = _ring_or_ulysses(config, q, k, v, attention_mask, scale, causal, window, sinks)
    unpadded = getattr(attention_mask, UNPADDED, None)
    if unpadded is None:  # no padding (or a mask cplib_mask did not make: its rows as they are)
        return out
    shards, keys = unpadded
    dead, any_dead = dead_rows_under_cp(shards, keys, causal, window, config.cu_seqlens)
    if not any_dead:
        return out
    return eager_dead_rows(out, q, k, v, dead, scale, shards.seq_len, shards.group, sinks)


def _ring_or_ulysses(config: RingConfig, q, k, v, attention_mask, scale, causal, window,
                     sinks) -> torch.Tensor:
    padding = _key_padding(attention_mask, k)
    kw: dict[str, Any] = {"is_causal": causal, "scale": scale,
                          "backend": sdpa_backend_hint(q.device)}
    kw.update(context_extras(config, window))
    if sinks is not None:
        kw["sinks"] = sinks
    if padding is not None:
        kw["attn_mask"] = padding
    if config.ulysses_degree == 1:
        out, _ = ring_sdpa(q, k, v, config.group_name, load_balanced=config.load_balanced,
                           rotate=config.rotate, **kw)
    elif config.ulysses_degree == config.world_size:
        _check_keywords(ulysses_sdpa, kw)
        out, _ = ulysses_sdpa(q, k, v, config.ulysses_group, **kw)
    else:
        _check_keywords(usp_sdpa, kw)
        out, _ = usp_sdpa(q, k, v, config.ulysses_group, config.group_name,
                          load_balanced=config.load_balanced, rotate=config.rotate, **kw)
    return out


@functools.lru_cache(maxsize=None)
def _keywords(fn) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


def _check_keywords(fn, kw: dict[str, Any]) -> None:
    # A layer's window (or the context's documents) on an entry point that
    # does not take them yet: say so, rather than a TypeError.
    missing = sorted(set(kw) - _keywords(fn))
    if missing:
        raise NotImplementedError(
            f"cplib attention: {fn.__name__} (ulysses_degree > 1) does not take {missing} "
            "(sliding windows, documents); use ulysses_degree=1 (the ring) for this model")


# ------------------------------------------------------------ one device


def _visible(q_len: int, kv_len: int, causal: bool, window, documents, padding,
             device) -> torch.Tensor | None:
    """Boolean (B or 1, 1, q_len, kv_len) mask of what each query sees, or
    None for plain (causal or full) attention. Queries are the last q_len of
    the kv_len positions (a cache in front of them)."""
    if window is None and documents is None and padding is None:
        return None
    qi = torch.arange(kv_len - q_len, kv_len, device=device).view(-1, 1)
    kj = torch.arange(kv_len, device=device).view(1, -1)
    see = torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
    if causal:
        see &= kj <= qi
    if window is not None:
        see &= (qi - kj <= window[0]) & (kj - qi <= window[1])
    see = see.view(1, 1, q_len, kv_len)
    if documents is not None:  # (B, S) document ids
        see = see & (documents[:, None, :, None] == documents[:, None, None, :])
    if padding is not None:  # (B, kv_len), False for padding tokens
        see = see & padding[:, None, None, :].bool()
    return see


def _documents(position_ids, q_len: int, kv_len: int, padding) -> torch.Tensor | None:
    # HF packs documents as position_ids that do not step by one (only
    # without a padding mask and a cache, as its own masks do).
    if position_ids is None or padding is not None or q_len != kv_len or q_len < 2:
        return None
    pos = position_ids.reshape(-1, position_ids.shape[-1])
    if pos.shape[-1] != q_len:
        return None
    first = pos[:, :1] - 1
    starts = torch.diff(pos, prepend=first, dim=-1) != 1
    if not bool(starts[:, 1:].any()):
        return None
    return starts.cumsum(-1)


def _single_device(q, k, v, attention_mask, scale, causal, window, sinks,
                   position_ids) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    if attention_mask is not None and attention_mask.dim() != 2:
        # An already prepared 4-D mask holds everything, as in HF's own paths.
        return _math_attention(q, k, v, attention_mask, scale, sinks, groups)
    q_len, kv_len = q.shape[2], k.shape[2]
    documents = _documents(position_ids, q_len, kv_len, attention_mask)
    see = _visible(q_len, kv_len, causal, window, documents, attention_mask, q.device)
    if see is None and causal and (q_len != kv_len or sinks is not None):
        # SDPA's is_causal aligns top-left; with a cache in front the queries are the last rows.
        see = _visible(q_len, kv_len, True, (kv_len, kv_len), None, None, q.device)
    dead = None if see is None else dead_rows_of(see)
    if dead is not None:
        see = see | dead[:, None, :, None]  # no NaN in those rows: they are replaced below
    if sinks is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=see,
                                             is_causal=causal and see is None, scale=scale,
                                             enable_gqa=groups > 1)
    else:
        out = _math_attention(q, k, v, see, scale, sinks, groups)
    if dead is None or not bool(dead.any()):
        return out
    return eager_dead_rows(out, q, k, v, dead, scale, kv_len, None, sinks)


def _math_attention(q, k, v, mask, scale, sinks, groups) -> torch.Tensor:
    """Attention as HF's eager path computes it, with sinks (one more logit
    per row, with no value) and a boolean or additive mask."""
    if groups > 1:
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool \
            else scores + mask
    if sinks is not None:
        sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs.to(v.dtype), v)
