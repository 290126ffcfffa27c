"""The document layout of the last ``_context_parallel_shard``, which the
SDPA calls of ``_ContextParallel`` modules check ``attention_documents``
against: inputs sharded per document or in the document placement, attended
as if they were head-tail (or the other way round, or with other documents),
would give a wrong result without a word."""

from __future__ import annotations

from itertools import accumulate
from typing import NamedTuple

import torch

__all__ = ["ShardLayout", "shard_layout_of", "check_documents_told"]

PLAIN, PER_DOCUMENT, PLACEMENT = "plain", "per_document", "placement"


class ShardLayout(NamedTuple):
    kind: str  # PLAIN (no documents in the layout), PER_DOCUMENT or PLACEMENT
    balancer: str  # its class name, for the error
    cu_seqlens: tuple[int, ...] | None  # the documents it was made for, where known


def shard_layout_of(load_balancer: object | None) -> ShardLayout:
    from ..ring.load_balancer import AnyLengthPerDocumentLoadBalancer, \
        _PerDocumentHeadTailLoadBalancer
    from ..ring.placement import DocumentPlacementLoadBalancer
    from ..ulysses.usp_layout import UspLoadBalancer

    name = type(load_balancer).__name__
    if isinstance(load_balancer, DocumentPlacementLoadBalancer):
        return ShardLayout(PLACEMENT, name, tuple(load_balancer.cu_seqlens))
    if isinstance(load_balancer, AnyLengthPerDocumentLoadBalancer):
        return ShardLayout(PER_DOCUMENT, name, tuple(load_balancer.cu_seqlens))
    if isinstance(load_balancer, UspLoadBalancer) and load_balancer.documents is not None:
        return ShardLayout(PER_DOCUMENT, name, tuple(load_balancer.documents))
    if isinstance(load_balancer, _PerDocumentHeadTailLoadBalancer):
        rows = {tuple(row) for row in load_balancer.seq_length_per_doc}
        bounds = tuple(accumulate(next(iter(rows)), initial=0)) if len(rows) == 1 else None
        return ShardLayout(PER_DOCUMENT, name, bounds)
    return ShardLayout(PLAIN, name, None)


def check_documents_told(sharded: ShardLayout | None, cu_seqlens: torch.Tensor | None,
                         per_document: bool, placement: bool) -> None:
    """ValueError unless the call's ``attention_documents`` (its bounds and
    flags) matches ``sharded``; None (nothing recorded: sharded some other
    way) is not checked."""
    if sharded is None:
        return
    told = PLACEMENT if placement else PER_DOCUMENT if per_document else PLAIN
    if sharded.kind != told:
        if sharded.kind == PLAIN:
            raise ValueError(
                f"cplib: attention_documents({told}=True), but the inputs were sharded by "
                f"_context_parallel_shard with {sharded.balancer}, which has no documents in "
                f"its layout; shard them with the matching load balancer")
        raise ValueError(
            f"cplib: the inputs were sharded by _context_parallel_shard with "
            f"{sharded.balancer} ({sharded.kind} layout); call the module inside "
            f"cplib.attention_documents(cu_seqlens, {sharded.kind}=True) with its documents")
    if sharded.cu_seqlens is not None and cu_seqlens is not None \
            and tuple(cu_seqlens.tolist()) != sharded.cu_seqlens:
        raise ValueError(
            f"cplib: attention_documents got cu_seqlens {cu_seqlens.tolist()[:8]}..., but the "
            f"inputs were sharded by {sharded.balancer} for cu_seqlens "
            f"{list(sharded.cu_seqlens[:8])}...; pass the same documents")
