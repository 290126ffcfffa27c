"""The blocks a model's code wraps its SDPA calls in, since SDPA has no
argument for them: ``cplib.attention_window`` (a sliding window) and
``cplib.attention_documents`` (packed documents, for ``_ContextParallel``
modules). Under context parallelism cplib's dispatch reads them
(sdpa_dispatch.py, style.py); without it the calls made inside get them in
this process (one_process_sdpa.py), so the code means the same either way."""

from __future__ import annotations

import contextlib
from collections.abc import Generator

import torch

from ..attention.args import check_cu_seqlens, window_arg
from ..attention.names import DOCUMENT_LAYOUTS, layout_of
from .documents import cu_seqlens_from_position_ids, documents_stack, windows_stack
from .one_process_sdpa import one_process_masks

__all__ = ["attention_window", "attention_documents"]


@contextlib.contextmanager
def attention_window(window: int | tuple[int | None, int | None] | None
                     ) -> Generator[None, None, None]:
    """Sliding window of the SDPA calls made inside (context-parallel or not):
    ``w`` or ``(left, right)`` (query i sees key j iff
    ``i - left <= j <= i + right`` in global positions; causal makes right 0;
    ``None`` on a side: no limit). ``attention_window(None)`` turns a
    context's default window off for these calls."""
    window_arg(window)  # ValueError on a bad window, before anything runs
    windows_stack.append(window)
    try:
        with one_process_masks():  # the calls made outside context parallelism
            yield
    finally:
        windows_stack.pop()


@contextlib.contextmanager
def attention_documents(cu_seqlens: torch.Tensor | None = None, *,
                        position_ids: torch.Tensor | None = None,
                        per_document: bool = False,
                        placement: bool = False) -> Generator[None, None, None]:
    """Packed documents for the SDPA calls of ``_ContextParallel`` modules
    made inside (and, with no context parallelism in effect, for every SDPA
    call made inside, in this process): ``cu_seqlens`` (``[0, s1, ..., S]``, global) or the full,
    unsharded ``position_ids`` (restarting at 0 at each document), as
    ``context_parallel`` takes them; attention stays within each document.
    ``per_document=True``: the inputs were sharded head-tail inside every
    document (``AnyLengthPerDocumentLoadBalancer``, or
    ``usp_load_balancer(..., cu_seqlens=...)`` with ``ulysses_degree``).
    ``placement=True``: they were sharded with
    ``DocumentPlacementLoadBalancer`` (ring only: ``ulysses_degree`` 1)."""
    if (cu_seqlens is None) == (position_ids is None):
        raise ValueError("cplib.attention_documents: pass cu_seqlens or position_ids (one)")
    layout = layout_of("attention_documents", per_document=per_document, placement=placement)
    if position_ids is not None:
        cu_seqlens = cu_seqlens_from_position_ids(position_ids)
    if not isinstance(cu_seqlens, torch.Tensor):
        cu_seqlens = torch.tensor(cu_seqlens)
    check_cu_seqlens("attention_documents", cu_seqlens, int(cu_seqlens[-1]))
    documents_stack.append((cu_seqlens.to("cpu", torch.long),
                            layout if layout in DOCUMENT_LAYOUTS else None))
    try:
        with one_process_masks():  # the calls made outside context parallelism
            yield
    finally:
        documents_stack.pop()
