"""The layout of the last ``_context_parallel_shard``, which the SDPA calls
of ``_ContextParallel`` modules, inside their forward, check how they would
read their inputs against (head-tail if a load balancer was given, as torch; per document or
in the placement under ``attention_documents``; the module's Ulysses
degree): inputs read in another layout than the one they were sharded in
would give a wrong result without a word."""

from __future__ import annotations

from itertools import accumulate
from typing import NamedTuple

import torch

from ..attention.names import DOCUMENT_LAYOUTS, Layout, layout_words

__all__ = ["ShardLayout", "shard_layout_of", "check_layout_read"]


class ShardLayout(NamedTuple):
    # The ring's layout of the shards; None: a layout SDPA cannot read (a
    # balancer of the user's own, torch's PTRR).
    kind: Layout | None
    balancer: str  # its class name, for the errors
    cu_seqlens: tuple[int, ...] | None  # the documents it was made for, where known
    ulysses_degree: int  # the USP degree it lays out for (1: the ring's layouts)
    # The load balancer itself, for FLEX calls without a BlockMask inside a
    # _ContextParallel module's forward (their positions: style.py).
    load_balancer: object = None


def shard_layout_of(load_balancer: object | None) -> ShardLayout:
    from ..ring.load_balancer import AnyLengthPerDocumentLoadBalancer, \
        _HeadTailLoadBalancer, _PerDocumentHeadTailLoadBalancer
    from ..ring.placement import DocumentPlacementLoadBalancer
    from ..ulysses.usp_layout import UspLoadBalancer

    lb, name = load_balancer, type(load_balancer).__name__
    if lb is None:
        return ShardLayout(Layout.SEQUENTIAL, "no load balancer", None, 1)
    if isinstance(lb, DocumentPlacementLoadBalancer):
        return ShardLayout(Layout.PLACEMENT, name, tuple(lb.cu_seqlens), 1)
    if isinstance(lb, AnyLengthPerDocumentLoadBalancer):
        return ShardLayout(Layout.PER_DOCUMENT, name, tuple(lb.cu_seqlens), 1)
    if isinstance(lb, _PerDocumentHeadTailLoadBalancer):
        rows = {tuple(row) for row in lb.seq_length_per_doc}
        bounds = tuple(accumulate(next(iter(rows)), initial=0)) if len(rows) == 1 else None
        return ShardLayout(Layout.PER_DOCUMENT, name, bounds, 1)
    if isinstance(lb, UspLoadBalancer):
        if lb.documents is not None:
            return ShardLayout(Layout.PER_DOCUMENT, name, tuple(lb.documents), lb.ulysses_degree)
        return ShardLayout(Layout.HEAD_TAIL if lb.head_tail else Layout.SEQUENTIAL, name, None,
                           lb.ulysses_degree)
    if isinstance(lb, _HeadTailLoadBalancer):
        return ShardLayout(Layout.HEAD_TAIL, name, None, 1)
    return ShardLayout(None, name, None, 1)


def _named(layout: Layout) -> str:
    """A layout in these errors: a documents layout by the keyword of
    ``attention_documents`` that reads it ("placement"), the others in words."""
    return str(layout) if layout in DOCUMENT_LAYOUTS else layout_words(layout)


def check_layout_read(sharded: ShardLayout | None, *, read: Layout,
                      cu_seqlens: torch.Tensor | None, world_size: int,
                      ulysses_degree: int) -> None:
    """Raises unless an SDPA call that reads its inputs in the layout
    ``read`` (``attention_documents``' ``per_document`` / ``placement``,
    else ``_cp_options.enable_load_balance``: cplib.attention.names.layout_of)
    with the documents ``cu_seqlens`` reads them in the layout ``sharded``;
    None (nothing recorded) is not checked."""
    if sharded is None:
        return
    where = f"the inputs were sharded by _context_parallel_shard with {sharded.balancer}"
    if sharded.kind is None:
        raise NotImplementedError(
            f"cplib: {where}, whose layout _ContextParallel's SDPA calls cannot read; they "
            "take no load balancer, head-tail, per-document, the document placement or "
            "cplib.usp_load_balancer")
    if sharded.ulysses_degree != ulysses_degree:
        raise ValueError(
            f"cplib: {where}, a layout for ulysses_degree={sharded.ulysses_degree}; this "
            f"module has ulysses_degree={ulysses_degree}: shard with "
            f"cplib.usp_load_balancer(S, {world_size}, {ulysses_degree})")
    kind = sharded.kind
    if world_size // ulysses_degree == 1:  # no ring: head-tail over one rank is the identity
        kind, read = (Layout.SEQUENTIAL if x == Layout.HEAD_TAIL else x for x in (kind, read))
    if kind != read:
        if kind in DOCUMENT_LAYOUTS:
            raise ValueError(
                f"cplib: {where} ({_named(kind)} layout); call the module inside "
                f"cplib.attention_documents(cu_seqlens, {kind}=True) with its documents")
        if read in DOCUMENT_LAYOUTS:
            raise ValueError(
                f"cplib: attention_documents({read}=True), but {where} ({_named(kind)} "
                "layout); shard them with the matching load balancer")
        raise ValueError(f"cplib: {where} ({_named(kind)} layout), but SDPA reads the shards "
                         f"of a load balancer as {_named(read)}")
    if sharded.cu_seqlens is not None and cu_seqlens is not None \
            and tuple(cu_seqlens.tolist()) != sharded.cu_seqlens:
        raise ValueError(
            f"cplib: attention_documents got cu_seqlens {cu_seqlens.tolist()[:8]}..., but "
            f"{where} for cu_seqlens {list(sharded.cu_seqlens[:8])}...; pass the same documents")
