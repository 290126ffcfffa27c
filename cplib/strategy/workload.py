"""What the cost model reads about one attention call: the global shapes, the
mask, the group and its topology, as plain numbers that every rank computes
alike (global, never local, lengths), so that the same call gives the same
``Workload`` on every rank and the same cache key."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

import torch

__all__ = ["Workload", "NO_LIMIT", "ranks_per_node", "element_size"]

# A window side without limit (the ring's own convention: sides are clamped to S).
NO_LIMIT = 2 ** 62


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def ranks_per_node(world_size: int, given: int | None = None) -> int:
    """Ranks of a group that share a node (and its fast links): ``given``, or
    the launcher's ``LOCAL_WORLD_SIZE`` (torchrun sets it), or the whole
    group. cplib's Ulysses groups are consecutive ranks, so a Ulysses degree
    that divides this keeps every all-to-all inside a node."""
    if given is None:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        given = int(env) if env and env.isdigit() and int(env) > 0 else world_size
    return max(1, min(int(given), world_size))


@dataclass(frozen=True)
class Workload:
    """One attention call, globally: ``seq_len`` tokens (all ranks together)
    of ``batch`` rows, ``q_heads`` / ``kv_heads`` heads of ``head_dim``
    (``v_head_dim`` for values), elements of ``element_size`` bytes, over a
    context-parallel group of ``world_size`` ranks, ``ranks_per_node`` of
    them per node. The mask: ``is_causal``, ``window`` (left, right), with
    ``NO_LIMIT`` for an open side, and ``documents`` (cu_seqlens, global).
    ``layout``: how the sequence is cut over the ranks (a
    cplib.attention.names.Layout's name: "head_tail", "sequential",
    "per_document", "placement"), or None
    when the candidate may choose it. ``backward``: forward + backward (the
    training step) or forward only. ``extras``: (name, value) pairs read by
    candidate families added later (a flex block mask's density, say)."""

    seq_len: int
    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    element_size: int
    world_size: int
    ranks_per_node: int
    is_causal: bool = True
    window: tuple[int, int] | None = None
    documents: tuple[int, ...] | None = None
    layout: str | None = None
    device_type: str = "cpu"
    backward: bool = True
    extras: tuple[tuple[str, Any], ...] = field(default=())

    @property
    def acc_size(self) -> int:
        """Bytes of the accumulator dtype (fp32; fp64 for fp64 inputs)."""
        return 8 if self.element_size == 8 else 4

    @property
    def sides(self) -> tuple[int, int]:
        """(left, right) window sides with causal folded in (right = 0)."""
        left, right = self.window if self.window is not None else (NO_LIMIT, NO_LIMIT)
        return min(left, NO_LIMIT), 0 if self.is_causal else min(right, NO_LIMIT)

    def mask_kind(self) -> str:
        """"dense", "causal", "documents", "window" or "documents+window" (with
        "causal " in front where it applies), or "flex" for a flex call (its
        BlockMask's plan is in ``extras``): what the cache keys on."""
        if self.extra("flex") is not None:
            return "flex"
        parts = []
        if self.documents is not None and len(self.documents) > 2:
            parts.append("documents")
        left, right = self.sides
        if left < self.seq_len - 1 or (right < self.seq_len - 1 and not self.is_causal):
            parts.append("window")
        kind = "+".join(parts) or "dense"
        return f"causal {kind}" if self.is_causal else kind

    def key(self) -> tuple:
        """The choice's cache key: shapes, mask kind, window, group size and
        topology, layout (documents by kind only: one choice serves every
        batch of packed documents)."""
        return (self.seq_len, self.batch, self.q_heads, self.kv_heads, self.head_dim,
                self.v_head_dim, self.element_size, self.world_size, self.ranks_per_node,
                self.mask_kind(), self.window, self.layout, self.device_type, self.backward,
                self.extras)

    def kv_heads_after(self, degree: int) -> int:
        """K/V heads a rank holds after a Ulysses exchange of ``degree`` (heads
        fewer than the degree are repeated to one per rank, never to Hq)."""
        if degree == 1:
            return self.kv_heads
        return max(self.kv_heads, degree) // degree

    def extra(self, name: str, default: Any = None) -> Any:
        return dict(self.extras).get(name, default)

    def with_layout(self, layout: str | None) -> "Workload":
        return replace(self, layout=layout)
