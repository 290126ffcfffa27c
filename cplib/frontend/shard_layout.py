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

__all__ = ["ShardLayout", "shard_layout_of", "check_layout_read"]

SEQUENTIAL, HEAD_TAIL, PER_DOCUMENT, PLACEMENT, OTHER = (
    "sequential", "head-tail", "per_document", "placement", "other")
DOCUMENTS = (PER_DOCUMENT, PLACEMENT)


class ShardLayout(NamedTuple):
    kind: str  # one of the five above (OTHER: a layout SDPA cannot read, e.g. PTRR)
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
        return ShardLayout(SEQUENTIAL, "no load balancer", None, 1)
    if isinstance(lb, DocumentPlacementLoadBalancer):
        return ShardLayout(PLACEMENT, name, tuple(lb.cu_seqlens), 1)
    if isinstance(lb, AnyLengthPerDocumentLoadBalancer):
        return ShardLayout(PER_DOCUMENT, name, tuple(lb.cu_seqlens), 1)
    if isinstance(lb, _PerDocumentHeadTailLoadBalancer):
        rows = {tuple(row) for row in lb.seq_length_per_doc}
        bounds = tuple(accumulate(next(iter(rows)), initial=0)) if len(rows) == 1 else None
        return ShardLayout(PER_DOCUMENT, name, bounds, 1)
    if isinstance(lb, UspLoadBalancer):
        if lb.documents is not None:
            return ShardLayout(PER_DOCUMENT, name, tuple(lb.documents), lb.ulysses_degree)
        return ShardLayout(HEAD_TAIL if lb.head_tail else SEQUENTIAL, name, None,
                           lb.ulysses_degree)
    if isinstance(lb, _HeadTailLoadBalancer):
        return ShardLayout(HEAD_TAIL, name, None, 1)
    return ShardLayout(OTHER, name, None, 1)


def check_layout_read(sharded: ShardLayout | None, *, load_balanced: bool, per_document: bool,
                      placement: bool, cu_seqlens: torch.Tensor | None, world_size: int,
                      ulysses_degree: int) -> None:
    """Raises unless an SDPA call that reads its inputs as the flags say
    (``attention_documents``' ``per_document`` / ``placement`` and bounds,
    ``load_balanced`` as ``_cp_options.enable_load_balance``) reads them in
    the layout ``sharded``; None (nothing recorded) is not checked."""
    if sharded is None:
        return
    where = f"the inputs were sharded by _context_parallel_shard with {sharded.balancer}"
    if sharded.kind == OTHER:
        raise NotImplementedError(
            f"cplib: {where}, whose layout _ContextParallel's SDPA calls cannot read; they "
            "take no load balancer, head-tail, per-document, the document placement or "
            "cplib.usp_load_balancer")
    if sharded.ulysses_degree != ulysses_degree:
        raise ValueError(
            f"cplib: {where}, a layout for ulysses_degree={sharded.ulysses_degree}; this "
            f"module has ulysses_degree={ulysses_degree}: shard with "
            f"cplib.usp_load_balancer(S, {world_size}, {ulysses_degree})")
    read = PLACEMENT if placement else PER_DOCUMENT if per_document else \
        HEAD_TAIL if load_balanced else SEQUENTIAL
    kind = sharded.kind
    if world_size // ulysses_degree == 1:  # no ring: head-tail over one rank is the identity
        kind, read = (SEQUENTIAL if x == HEAD_TAIL else x for x in (kind, read))
    if kind != read:
        if kind in DOCUMENTS:
            raise ValueError(
                f"cplib: {where} ({kind} layout); call the module inside "
                f"cplib.attention_documents(cu_seqlens, {kind}=True) with its documents")
        if read in DOCUMENTS:
            raise ValueError(
                f"cplib: attention_documents({read}=True), but {where} ({kind} layout); "
                "shard them with the matching load balancer")
        raise ValueError(f"cplib: {where} ({kind} layout), but SDPA reads the shards of a "
                         f"load balancer as {read}")
    if sharded.cu_seqlens is not None and cu_seqlens is not None \
            and tuple(cu_seqlens.tolist()) != sharded.cu_seqlens:
        raise ValueError(
            f"cplib: attention_documents got cu_seqlens {cu_seqlens.tolist()[:8]}..., but "
            f"{where} for cu_seqlens {list(sharded.cu_seqlens[:8])}...; pass the same documents")
