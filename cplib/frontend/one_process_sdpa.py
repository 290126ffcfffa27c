"""SDPA calls made inside ``cplib.attention_window`` or
``cplib.attention_documents`` blocks while no context parallelism is in
effect: computed in this process with the block's window and documents, so
that one model's code means the same with context parallelism and without
(before, those calls ran torch's SDPA, the window and the documents
silently dropped).

Each block enters a ``OneProcessMasks`` mode (once: nested blocks share the
outermost). Under context parallelism (a region, or the dispatcher that
``_ContextParallel`` modules need: cplib/frontend/sdpa_dispatch.py) it
passes every call on: cplib's dispatch routes the calls of the region and of
the parallelized modules with the same window and documents, and leaves the
model's other SDPA calls (on sequences it did not shard) alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Callable

import torch
from torch._ops import HigherOrderOperator
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from ..attention.args import window_arg
from .documents import current_window, documents_stack
from .mode_kept import AUTOGRAD_ENTRIES, autograd_with_mode, body_with_mode, with_inner_sdpa
from .sdpa_dispatch import CALLS_SDPA, MHA, check_mha_weights, active_config, dispatcher_enabled

__all__ = ["OneProcessMasks", "one_process_masks", "masked_sdpa"]

_SDPA = torch._C._nn.scaled_dot_product_attention


class OneProcessMasks(TorchFunctionMode):
    """Routes SDPA calls made outside context parallelism to masked_sdpa."""

    def __torch_function__(self, func: Callable, types_: tuple, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if active_config() is None and not dispatcher_enabled():
            if func is _SDPA:
                return masked_sdpa(*args, **kwargs)
            if func is MHA and (current_window(None) is not None or documents_stack):
                check_mha_weights(args, kwargs, "cplib cannot give a window or documents")
            if func in CALLS_SDPA:
                return with_inner_sdpa(self, masked_sdpa, func, types_, args, kwargs)
        if func in AUTOGRAD_ENTRIES:  # a checkpointed block recomputes with the masks
            return autograd_with_mode(self, func, types_, args, kwargs)
        if isinstance(func, HigherOrderOperator):  # a compiled checkpoint's body
            return body_with_mode(self, func, types_, args, kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def one_process_masks() -> Iterator[None]:
    """Enters a OneProcessMasks mode unless one is active already."""
    if any(isinstance(m, OneProcessMasks) for m in _get_current_function_mode_stack()):
        yield
        return
    with OneProcessMasks():
        yield


def _visible(l_len: int, window: list[int] | None, cu_seqlens: torch.Tensor | None,
             is_causal: bool, device: torch.device) -> torch.Tensor:
    """(L, L) boolean: query i sees key j (positions 0..L-1 of one sequence)."""
    i = torch.arange(l_len, device=device).view(-1, 1)
    j = torch.arange(l_len, device=device).view(1, -1)
    see = torch.ones(l_len, l_len, dtype=torch.bool, device=device)
    if is_causal:
        see = see & (j <= i)
    if window is not None:
        see = see & (i - j <= window[0]) & (j - i <= window[1])
    if cu_seqlens is not None:
        # Document of each position (bucketize keeps shapes static for dynamo).
        doc = torch.bucketize(torch.arange(l_len), cu_seqlens[1:], right=True).to(device)
        see = see & (doc.view(-1, 1) == doc.view(1, -1))
    return see


def masked_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                is_causal: bool = False, scale: float | None = None,
                enable_gqa: bool = False) -> torch.Tensor:
    """SDPA with the innermost ``attention_window`` and ``attention_documents``
    (a row that sees no key gives zeros, as cplib's ring does)."""
    window = window_arg(current_window(None))
    cu_seqlens = documents_stack[-1][0] if documents_stack else None
    if window is None and cu_seqlens is None:
        return _SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                     is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    l_len, s_len = query.shape[-2], key.shape[-2]
    if l_len != s_len:
        raise NotImplementedError(
            f"cplib: attention_window/attention_documents give positions to self-attention "
            f"(as many queries as keys); this SDPA call has {l_len} queries and {s_len} keys")
    if cu_seqlens is not None and int(cu_seqlens[-1]) != l_len:
        raise ValueError(
            f"cplib.attention_documents: the documents cover {int(cu_seqlens[-1])} tokens but "
            f"this SDPA call, outside context parallelism, has a sequence of {l_len}")
    see = _visible(l_len, window, cu_seqlens, is_causal, query.device)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        see = see & attn_mask
    seen = see.any(-1, keepdim=True)
    # A row that sees nothing attends everywhere (no NaN in the kernel, nor
    # in its backward), and its output is zeroed.
    see = see | ~seen
    mask: torch.Tensor = see
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        mask = attn_mask.masked_fill(~see, float("-inf"))
    out = _SDPA(query, key, value, attn_mask=mask, dropout_p=dropout_p, is_causal=False,
                scale=scale, enable_gqa=enable_gqa)
    return torch.where(seen, out, out.new_zeros(()))
