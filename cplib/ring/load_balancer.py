"""Load balancers: permutations of the sequence applied before sharding so
that causal (or document-causal) attention costs about the same on every rank.

Same classes, constructors and ``_generate_indices(restore=False)`` contract as
torch's ``_context_parallel._load_balancer``: the result ``idx`` has shape
``(1, S)`` (one permutation for the whole batch) or ``(B, S)``; ``x[..., idx]``
along the sequence is the rearranged tensor, and with ``restore=True`` the
inverse permutation, so that ``x[idx][restore_idx] == x``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
from torch import Tensor

from ..attention.layout import layout_indices, local_length

__all__ = [
    "_LoadBalancer",
    "_HeadTailLoadBalancer",
    "_PerDocumentHeadTailLoadBalancer",
    "_PTRRLoadBalancer",
    "AnyLengthHeadTailLoadBalancer",
    "AnyLengthPerDocumentLoadBalancer",
    "head_tail_indices",
    "inverse_permutation",
    "rearrange",
]


def _check_count(what: str, value, minimum: int) -> int:
    """A non-negative (or positive) int argument of a balancer, or ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"cplib: {what} must be an int >= {minimum}, got {value!r}")
    return value


def document_bounds(cu_seqlens: Sequence[int] | Tensor) -> list[int]:
    """``cu_seqlens`` as a list of ints, checked: ``[0, ..., S]``, strictly
    increasing (ValueError naming the value otherwise)."""
    if isinstance(cu_seqlens, Tensor):
        cu_seqlens = cu_seqlens.tolist()
    if not isinstance(cu_seqlens, Sequence) or len(cu_seqlens) < 2 or any(
            isinstance(x, bool) or not isinstance(x, int) for x in cu_seqlens):
        raise ValueError(f"cplib: cu_seqlens must be a sequence of ints [0, ..., S], got "
                         f"{cu_seqlens!r}")
    if cu_seqlens[0] != 0:
        raise ValueError(f"cplib: cu_seqlens={list(cu_seqlens)} must start at 0 (document "
                         f"boundaries [0, ..., S]), got {cu_seqlens[0]}")
    for i, (a, b) in enumerate(zip(cu_seqlens, cu_seqlens[1:])):
        if b <= a:
            raise ValueError(f"cplib: cu_seqlens={list(cu_seqlens)} must be strictly increasing "
                             f"(document boundaries): document {i} ([{a}, {b})) has length "
                             f"{b - a}")
    return [int(x) for x in cu_seqlens]


def inverse_permutation(perm: Tensor) -> Tensor:
    """Inverse of a permutation along the last dimension."""
    return torch.argsort(perm, dim=-1)


def head_tail_indices(seq_length: int, world_size: int,
                      device: str | torch.device = "cpu") -> Tensor:
    """The head-tail permutation of ``range(seq_length)`` as a 1-D long tensor.

    The sequence is cut into ``2 * world_size`` equal chunks and rank ``r``
    gets chunks ``r`` and ``2 * world_size - 1 - r`` (in that order), so every
    rank holds one cheap and one expensive part of a causal mask.
    """
    if world_size < 1:
        raise ValueError(f"cplib: world_size must be >= 1, got {world_size}")
    if seq_length % (2 * world_size) != 0:
        raise ValueError(
            f"cplib: head-tail load balancing needs the sequence length ({seq_length}) "
            f"to be divisible by 2 * world_size = {2 * world_size}"
        )
    chunk = seq_length // (2 * world_size)
    ranks = torch.arange(world_size, device=device)
    # (world_size, 2): chunk ids held by each rank, head first.
    chunk_ids = torch.stack([ranks, 2 * world_size - 1 - ranks], dim=1)
    offsets = torch.arange(chunk, device=device)
    return (chunk_ids.unsqueeze(-1) * chunk + offsets).reshape(-1)


def rearrange(tensor: Tensor, seq_dim: int, indices: Tensor) -> Tensor:
    """Applies load-balancer indices to ``tensor`` along ``seq_dim``.

    ``indices`` is ``(1, S)`` (the same permutation for every batch row) or
    ``(B, S)`` (row ``b`` of dimension 0 uses ``indices[b]``; dimension 0 is
    the batch, as in torch). Returns a new tensor; ``tensor`` may be a
    broadcast view such as ``arange(S).expand(B, S)``.
    """
    if indices.ndim != 2:
        raise ValueError(
            f"cplib: load-balance indices must have shape (1, S) or (B, S), got "
            f"{tuple(indices.shape)}"
        )
    if tensor.ndim == 0 or not -tensor.ndim <= seq_dim < tensor.ndim:
        raise ValueError(f"cplib: seq_dim={seq_dim} is out of range for a tensor of shape "
                         f"{tuple(tensor.shape)}")
    dim = seq_dim % tensor.ndim
    if tensor.shape[dim] != indices.shape[1]:
        raise ValueError(
            f"cplib: load-balance indices cover {indices.shape[1]} positions but the tensor has "
            f"{tensor.shape[dim]} along seq_dim={seq_dim} (shape {tuple(tensor.shape)})"
        )
    indices = indices.to(device=tensor.device, dtype=torch.long)
    if indices.shape[0] == 1:
        return torch.index_select(tensor, dim, indices[0])
    if dim == 0 or indices.shape[0] != tensor.shape[0]:
        raise ValueError(
            f"cplib: per-batch load-balance indices of shape {tuple(indices.shape)} need "
            f"dimension 0 of the tensor to be a batch of {indices.shape[0]} rows and seq_dim > 0; "
            f"got shape {tuple(tensor.shape)} with seq_dim={seq_dim}"
        )
    view = [indices.shape[0]] + [1] * (tensor.ndim - 1)
    view[dim] = indices.shape[1]
    return torch.gather(tensor, dim, indices.view(view).expand(tensor.shape))


class _LoadBalancer(ABC):
    """A strategy that rearranges the sequence before it is cut into
    ``world_size`` contiguous shards."""

    @abstractmethod
    def _generate_indices(self, restore: bool = False) -> Tensor | None:
        """Rearrange indices (``restore=False``) or their inverse
        (``restore=True``), shape ``(1, S)`` or ``(B, S)``."""


class _HeadTailLoadBalancer(_LoadBalancer):
    """Head-tail balancing for causal attention (one permutation per batch)."""

    def __init__(self, seq_length: int, world_size: int, device: str | torch.device):
        _check_count("seq_length", seq_length, 0)
        _check_count("world_size", world_size, 1)
        self.seq_length = seq_length
        self.world_size = world_size
        self.device = device

    def _generate_indices(self, restore: bool = False) -> Tensor:
        perm = head_tail_indices(self.seq_length, self.world_size, self.device)
        return (inverse_permutation(perm) if restore else perm).unsqueeze(0)


class AnyLengthHeadTailLoadBalancer(_HeadTailLoadBalancer):
    """Head-tail balancing for any sequence length >= world size: the 2N
    chunks differ by at most one token (``cplib.attention.layout``), so shards
    differ by at most one token per chunk; for lengths divisible by 2N it is
    exactly :class:`_HeadTailLoadBalancer`. Shards are cut with
    :func:`shard_lengths`, not in equal parts."""

    def _generate_indices(self, restore: bool = False) -> Tensor:
        if self.seq_length < self.world_size:
            raise ValueError(f"cplib: sequence length {self.seq_length} is shorter than the "
                             f"world size {self.world_size}")
        perm = layout_indices(self.seq_length, self.world_size, True, self.device)
        return (inverse_permutation(perm) if restore else perm).unsqueeze(0)


class AnyLengthPerDocumentLoadBalancer(_LoadBalancer):
    """Head-tail balancing inside every document of a packed sequence, for
    any document lengths: rank r holds chunks r and 2N-1-r of every document
    (2N chunks per document, sizes within one token), documents in order. The
    layout the ring takes with ``per_document=True``; for lengths divisible by
    2N it is :class:`_PerDocumentHeadTailLoadBalancer`'s (one batch row)."""

    def __init__(self, cu_seqlens: Sequence[int], world_size: int,
                 device: str | torch.device):
        self.cu_seqlens = document_bounds(cu_seqlens)
        _check_count("world_size", world_size, 1)
        self.seq_length = self.cu_seqlens[-1]
        self.world_size = world_size
        self.device = device

    def _generate_indices(self, restore: bool = False) -> Tensor:
        perm = layout_indices(self.seq_length, self.world_size, True, self.device,
                              self.cu_seqlens)
        return (inverse_permutation(perm) if restore else perm).unsqueeze(0)

    def lengths(self) -> list[int]:
        return [local_length(self.seq_length, self.world_size, r, True, self.cu_seqlens)
                for r in range(self.world_size)]


def shard_lengths(seq_length: int, world_size: int,
                  load_balancer: _LoadBalancer | None) -> list[int] | None:
    """Every rank's shard length for a sequence of ``seq_length`` cut after
    ``load_balancer``'s rearrangement, or None for equal parts (lengths that
    divide; other balancers need them)."""
    if callable(getattr(load_balancer, "lengths", None)):  # a layout that knows its shards
        lengths = load_balancer.lengths()
        return None if len(set(lengths)) == 1 else lengths
    if seq_length % world_size == 0:  # head-tail shards are then equal too
        return None
    if load_balancer is None or isinstance(load_balancer, AnyLengthHeadTailLoadBalancer):
        head_tail = load_balancer is not None
        return [local_length(seq_length, world_size, r, head_tail) for r in range(world_size)]
    return None


class _PerDocumentHeadTailLoadBalancer(_LoadBalancer):
    """Head-tail balancing applied inside every document of a packed sequence.

    ``seq_length_per_doc[b]`` lists the document lengths of batch row ``b``
    (one row if every row is packed the same way); each length must be
    divisible by ``2 * world_size``. Rank ``r``'s shard holds, for every
    document in order, that document's chunks ``r`` and ``2N-1-r``: the layout
    drawn in torch's docstring. (torch's code emits the chunks document-major
    instead, which leaves whole documents on one rank; cplib follows the
    documented, balanced layout.)
    """

    def __init__(self, seq_length_per_doc: Sequence[Sequence[int]], world_size: int,
                 device: str | torch.device):
        for row in seq_length_per_doc:
            for length in row:
                _check_count("every document length in seq_length_per_doc", length, 1)
        _check_count("world_size", world_size, 1)
        self.seq_length_per_doc = seq_length_per_doc
        self.world_size = world_size
        self.device = device

    def _row(self, doc_lengths: Sequence[int]) -> Tensor:
        n = self.world_size
        bad = [length for length in doc_lengths if length % (2 * n) != 0]
        if bad:
            raise ValueError(
                f"cplib: per-document load balancing needs every document length to be "
                f"divisible by 2 * world_size = {2 * n}; got lengths {list(doc_lengths)}"
            )
        starts = [0]
        for length in doc_lengths[:-1]:
            starts.append(starts[-1] + length)
        per_rank: list[list[Tensor]] = [[] for _ in range(n)]
        for start, length in zip(starts, doc_lengths):
            local = head_tail_indices(length, n, self.device) + start
            for r, piece in enumerate(local.chunk(n)):
                per_rank[r].append(piece)
        return torch.cat([torch.cat(pieces) for pieces in per_rank])

    def _generate_indices(self, restore: bool = False) -> Tensor:
        rows = [self._row(lengths) for lengths in self.seq_length_per_doc]
        if len({row.numel() for row in rows}) != 1:
            raise ValueError(
                "cplib: every batch row of seq_length_per_doc must sum to the same "
                f"sequence length; got {[row.numel() for row in rows]}"
            )
        perm = torch.stack(rows)
        return inverse_permutation(perm) if restore else perm


class _PTRRLoadBalancer(_LoadBalancer):
    """Processing-Time based Round-Robin balancing for flex attention.

    Each query block's cost is its number of non-empty key blocks in
    ``block_mask`` (shape ``(B, 1, S, S)`` or ``(1, 1, S, S)``); blocks are
    dealt to ranks in descending cost, snaking back and forth so that sums
    stay close.
    """

    def __init__(self, block_mask, world_size: int):  # block_mask: BlockMask
        if not all(hasattr(block_mask, a) for a in ("BLOCK_SIZE", "kv_num_blocks")):
            raise ValueError(f"cplib: block_mask must be a flex attention BlockMask, got "
                             f"{type(block_mask).__name__}")
        _check_count("world_size", world_size, 1)
        self.block_mask = block_mask
        self.world_size = world_size

    @staticmethod
    def ptrr_scheduling(process_time: Tensor, group_size: int) -> Tensor:
        """Splits ``len(process_time)`` tasks into ``group_size`` groups of
        equal count: returns a ``(group_size, n // group_size)`` tensor of task
        ids, each row sorted. Ties keep their original order."""
        if process_time.ndim != 1:
            raise ValueError(
                f"cplib: process_time must be 1-D, got shape {tuple(process_time.shape)}"
            )
        n = process_time.numel()
        if n % group_size != 0:
            raise NotImplementedError(
                f"cplib: PTRR num_tasks {n} must be divisible by group_size {group_size}"
            )
        order = torch.sort(process_time, descending=True, stable=True).indices
        rounds = order.view(-1, group_size).clone()
        rounds[1::2] = rounds[1::2].flip(-1)  # odd rounds deal right to left
        return torch.sort(rounds.t(), dim=1).values

    def _generate_indices(self, restore: bool = False) -> Tensor:
        bm = self.block_mask
        q_block, kv_block = bm.BLOCK_SIZE
        if q_block != kv_block:
            raise NotImplementedError(
                f"cplib: PTRR needs equal query and key block sizes, got {bm.BLOCK_SIZE}"
            )
        cost = bm.kv_num_blocks
        if bm.full_kv_num_blocks is not None:
            cost = cost + bm.full_kv_num_blocks
        if cost.size(1) != 1:
            raise ValueError(
                "cplib: PTRR needs a block mask that is identical across heads "
                f"(head dimension 1), got kv_num_blocks of shape {tuple(cost.shape)}"
            )
        cost = cost[:, 0]  # (B, num_q_blocks)
        rows = []
        for row_cost in cost:
            blocks = self.ptrr_scheduling(row_cost, self.world_size).reshape(-1)
            offsets = torch.arange(q_block, device=blocks.device)
            rows.append((blocks.unsqueeze(-1) * q_block + offsets).reshape(-1))
        perm = torch.stack(rows)
        return inverse_permutation(perm) if restore else perm


def _create_default_load_balancer(seq_length: int, world_size: int,
                                  device: str | torch.device,
                                  enable: bool) -> _LoadBalancer | None:
    """Head-tail when ``enable`` and the length divides evenly, else None
    (sequential sharding), as torch decides inside ``context_parallel``."""
    if enable and seq_length % (2 * world_size) == 0:
        return _HeadTailLoadBalancer(seq_length, world_size, device)
    return None
