"""A KV cache sharded over a process group for context-parallel inference.

Every rank keeps only its own rows of each layer's keys and values, with
their global positions. New tokens are dealt over the ranks (a prompt in
contiguous chunks, later tokens round-robin starting after the ranks that
already hold one more), so every rank holds about P/N of P cached tokens.
``cplib.ring_sdpa`` (prefill, with ``q_positions``/``kv_positions``) and
``cplib.decode_sdpa`` read the shards where they are.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm.native import GroupLike

__all__ = ["ShardedKVCache"]


class ShardedKVCache:
    """This rank's shard of a KV cache of ``num_layers`` layers over ``group``.

    Per step: ``mine = cache.deal(count)`` assigns the next ``count`` global
    positions and returns the indices (into those new tokens) this rank
    keeps; then, for every layer, ``k, v = cache.update(layer, k_new, v_new)``
    appends this rank's rows (B, Hkv, len(mine), D) and returns the whole
    local shard; ``cache.positions`` are its global positions."""

    def __init__(self, group: GroupLike, num_layers: int):
        if num_layers < 1:
            raise ValueError(f"cplib.ShardedKVCache: num_layers={num_layers} must be >= 1")
        if isinstance(group, str):
            group = dist.distributed_c10d._resolve_process_group(group)
        self.group = group
        self.rank, self.world = group.rank(), group.size()
        self.seq_len = 0  # global tokens cached so far
        self._next = 0    # the rank the next round-robin token goes to
        self._pos = torch.empty(0, dtype=torch.long)
        self._len = 0
        self._k: list[torch.Tensor | None] = [None] * num_layers
        self._v: list[torch.Tensor | None] = [None] * num_layers
        self._filled = [0] * num_layers

    @property
    def positions(self) -> torch.Tensor:
        """Global positions of this rank's cached rows, in local order (int64, CPU)."""
        return self._pos[: self._len]

    def __len__(self) -> int:
        return self._len

    def deal(self, count: int, *, contiguous: bool = False) -> torch.Tensor:
        """Assigns global positions ``[seq_len, seq_len + count)`` over the ranks
        and returns the (sorted, int64) indices of those this rank keeps. With
        ``contiguous`` the ranks take N contiguous chunks whose sizes differ by
        at most one, else token i goes to rank ``(next + i) mod N``; both
        start at the rank ``next`` after the last deal, so the shards never
        differ by more than one row."""
        if count < 0:
            raise ValueError(f"cplib.ShardedKVCache.deal: count={count} must be >= 0")
        n, r = self.world, self.rank
        first = (r - self._next) % n  # our turn in this deal
        if contiguous:
            base, extra = divmod(count, n)
            start = first * base + min(first, extra)
            mine = torch.arange(start, start + base + (first < extra), dtype=torch.long)
        else:
            mine = torch.arange(min(first, count), count, n, dtype=torch.long)
        # The ranks that got one token more are next in line last.
        self._next = (self._next + count) % n
        self._append_positions(self.seq_len + mine)
        self.seq_len += count
        return mine

    def _append_positions(self, pos: torch.Tensor) -> None:
        need = self._len + pos.numel()
        if need > self._pos.numel():
            grown = torch.empty(max(need, 2 * self._pos.numel(), 16), dtype=torch.long)
            grown[: self._len] = self._pos[: self._len]
            self._pos = grown
        self._pos[self._len: need] = pos
        self._len = need

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Appends this rank's new rows of ``layer`` (the rows ``deal`` gave it)
        and returns its whole shard (B, Hkv, len(self), D) of keys and values
        (views of a buffer that grows geometrically; valid until the next
        ``update`` of this layer)."""
        if k.dim() != 4 or v.dim() != 4 or k.shape[2] != v.shape[2]:
            raise ValueError(f"cplib.ShardedKVCache.update: expected k, v (B, Hkv, rows, D), got "
                             f"{tuple(k.shape)} and {tuple(v.shape)}")
        end = self._filled[layer] + k.shape[2]
        if end != self._len:
            raise ValueError(f"cplib.ShardedKVCache.update: layer {layer} would hold {end} rows "
                             f"but deal() gave this rank {self._len} positions")
        for store, new in ((self._k, k), (self._v, v)):
            buf = store[layer]
            if buf is None or buf.shape[2] < end:
                cap = max(end, 2 * (0 if buf is None else buf.shape[2]), 16)
                grown = new.new_empty((*new.shape[:2], cap, new.shape[3]))
                if buf is not None:
                    grown[:, :, : self._filled[layer]] = buf[:, :, : self._filled[layer]]
                store[layer] = buf = grown
            buf[:, :, self._filled[layer]: end] = new
        self._filled[layer] = end
        return self._k[layer][:, :, :end], self._v[layer][:, :, :end]

    def memory_bytes(self) -> int:
        """Bytes of the cached keys and values this rank holds (rows in use)."""
        total = 0
        for store in (self._k, self._v):
            for layer, buf in enumerate(store):
                if buf is not None:
                    total += buf[:, :, : self._filled[layer]].nbytes
        return total
