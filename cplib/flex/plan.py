"""The flex ring's plan: which K/V blocks each rank's queries need, read off
the sharded BlockMask's block lists, and the exchange schedule that follows.

Rank r holds rows ``[r*L, (r+1)*L)`` of the (load-balancer rearranged)
sequence. Its sharded BlockMask covers its L queries against all S keys in
that same order, so the key blocks of rank j are the mask's block columns
``[j*L/KB, (j+1)*L/KB)``. Each rank reduces its block lists (partial and full)
to "which key blocks does any of my query blocks see", one small all-gather
shares those vectors, and every rank derives the same schedule from them:

* step 0 attends this rank's own K/V (no exchange);
* step with offset d > 0 attends the rows of rank ``r - d`` that rank r needs
  (only those: a targeted exchange when the mask is sparse, the whole shard
  when it is not) and sends rank ``r + d`` the rows of ours that it needs.
  Offsets that no rank needs are not visited at all.
* each step's call takes only the span of our query rows that see any of
  the attended blocks (under head-tail, half of them on every step but the
  first): a kernel that computes a call's whole area (flex on the CPU)
  computes no rows that the mask rules out, and one that skips empty
  blocks (Triton) launches fewer.

Each step has its own BlockMask: the local mask's block columns of the
attended rows, renumbered, with a mask_mod that sees global (original)
positions. The plan is made once per sharded BlockMask (once per batch's
mask, whatever the number of layers) and attached to it.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch
from torch.nn.attention.flex_attention import BlockMask

from ..comm.native import ops

__all__ = ["RingStep", "FlexShard", "plan_shard", "dense_shard", "dense_block_map", "positions_mod",
           "SHARD_ATTR"]

# The attribute of a sharded BlockMask that holds its FlexShard.
SHARD_ATTR = "_cplib_flex_shard"


@dataclass(eq=False)
class RingStep:
    """One step of the ring on this rank."""

    offset: int
    src: int                      # the rank whose K/V rows this step attends
    dst: int                      # the rank that attends our rows at this step
    recv_rows: int                # rows received from src (0 at step 0 and when none)
    send_rows: int                # rows of ours sent to dst
    send_index: torch.Tensor | None  # which rows go to dst, when not all of them
    compute: bool                 # whether any of our queries sees the attended rows
    mask: BlockMask | None        # (our queries q_rows x the attended rows); None: no mask
    kv_positions: torch.Tensor    # (1|B, rows): original positions of the attended rows
    q_rows: tuple[int, int]       # [start, end) of our query rows that see the attended rows
    q_positions: torch.Tensor     # (1|B, end - start): their original positions (own storage)
    # q_rows as "start:end", what compiled code reads: dynamo makes an int
    # attribute that differs between two masks' graphs symbolic (and then
    # fails inside flex_attention's length checks), never a string.
    q_span: str = field(init=False)

    def __post_init__(self) -> None:
        self.q_span = f"{self.q_rows[0]}:{self.q_rows[1]}"


@dataclass(eq=False)
class FlexShard:
    """This rank's part of a sharded flex sequence: its layout and ring plan."""

    group_name: str
    world: int
    rank: int
    q_len: int                    # L: this rank's queries (and keys)
    kv_len: int                   # S: the whole sequence
    block_size: tuple[int, int]
    q_positions: torch.Tensor     # (1|B, L): original positions of our queries
    positions: torch.Tensor       # (1|B, S): original position of each rearranged one
    steps: tuple[RingStep, ...]
    plan_hash: int                # the same on every rank of one plan
    unsupported: str | None = None  # why the ring cannot run on this mask (the all-gather can)

    @property
    def calls(self) -> int:
        """flex_attention calls of one forward on this rank."""
        return sum(s.compute for s in self.steps)

    @property
    def recv_rows(self) -> int:
        """K/V rows this rank receives in one forward."""
        return sum(s.recv_rows for s in self.steps)


def dense_block_map(num_blocks: torch.Tensor, indices: torch.Tensor, cols: int) -> torch.Tensor:
    """Block lists (first ``num_blocks`` of each row of ``indices``) as a
    dense ``(..., rows, cols)`` bool map."""
    valid = torch.arange(indices.shape[-1], device=indices.device) < num_blocks.unsqueeze(-1)
    where = torch.where(valid, indices.long(), cols)  # invalid entries to a spare column
    dense = torch.zeros(*indices.shape[:-1], cols + 1, dtype=torch.bool, device=indices.device)
    return dense.scatter_(-1, where, True)[..., :cols]


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense block map as BlockMask block lists: counts and indices, the
    visible blocks first, in column order."""
    num = dense.sum(-1, dtype=torch.int32)
    idx = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True)
    return num, idx.to(torch.int32)


def positions_mod(fn, q_pos: torch.Tensor, kv_pos: torch.Tensor, score: bool):
    """``fn`` (a mask_mod, or a score_mod when ``score``) called on original
    positions: local query index q is ``q_pos[b, q]``, attended key index
    kv is ``kv_pos[b, kv]`` (one row broadcast over the batch)."""
    if q_pos.size(0) == 1:
        q_row, kv_row = q_pos[0], kv_pos[0]
        if score:
            def global_score_mod(s, b, h, q, kv):
                return fn(s, b, h, q_row[q], kv_row[kv])
            return global_score_mod

        def global_mask_mod(b, h, q, kv):
            return fn(b, h, q_row[q], kv_row[kv])
        return global_mask_mod
    if score:
        def global_score_mod_batched(s, b, h, q, kv):
            return fn(s, b, h, q_pos[b, q], kv_pos[b, kv])
        return global_score_mod_batched

    def global_mask_mod_batched(b, h, q, kv):
        return fn(b, h, q_pos[b, q], kv_pos[b, kv])
    return global_mask_mod_batched


def _rows(blocks: torch.Tensor, block: int) -> torch.Tensor:
    """The rows of key blocks ``blocks`` (block ids) of ``block`` rows each."""
    return (blocks.unsqueeze(-1) * block + torch.arange(block, device=blocks.device)).reshape(-1)


def _seeing_blocks(visible: torch.Tensor) -> tuple[int, int]:
    """The span ``[first, end)`` of query blocks with any visible block in
    ``visible`` ``(B, H, query blocks, key blocks)`` (one exists)."""
    seen = visible.flatten(0, 1).any(0).any(-1).nonzero().flatten().tolist()
    return seen[0], seen[-1] + 1


def _gather_needs(need: torch.Tensor, group_name: str, world: int) -> torch.Tensor:
    """Every rank's need vector: ``(world, T)`` bool on the host."""
    if world == 1:
        return need.unsqueeze(0).cpu()
    buf = ops.c10d_all_gather(need.to(torch.uint8).contiguous(), world, group_name)
    buf = torch.ops._c10d_functional.wait_tensor(buf)
    return buf.view(world, -1).cpu().bool()


def plan_shard(block_mask: BlockMask, mask_mod, group_name: str, world: int, rank: int,
               q_pos: torch.Tensor, positions: torch.Tensor) -> FlexShard:
    """The plan of ``block_mask`` (this rank's shard, keys over the whole
    rearranged sequence) for ``mask_mod`` on global positions; ``q_pos``
    ``(1|B, L)`` and ``positions`` ``(1|B, S)`` are the original positions of
    this rank's queries and of each rearranged key. Collective over the group
    (one small all-gather) unless the ring cannot run on the mask."""
    q_len, kv_len = block_mask.seq_lengths
    qb, kb = block_mask.BLOCK_SIZE
    unsupported = None
    if q_len % kb or kv_len != world * q_len:
        unsupported = (f"the flex ring attends whole key blocks of each rank, so each rank's "
                       f"length ({q_len}) must be a multiple of the mask's KV block size {kb} "
                       f"and the mask must cover the whole sequence ({world} x {q_len}, got "
                       f"{kv_len}); choose another block size or set_rotate_method('allgather')")
    if unsupported is not None:  # the same on every rank: none gathers
        return FlexShard(group_name, world, rank, q_len, kv_len, (qb, kb), q_pos, positions, (),
                         0, unsupported)
    per_rank, total = q_len // kb, kv_len // kb
    partial = dense_block_map(block_mask.kv_num_blocks, block_mask.kv_indices, total)
    full = (dense_block_map(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, total)
            if block_mask.full_kv_num_blocks is not None else torch.zeros_like(partial))
    need = _gather_needs((partial | full).flatten(0, 2).any(0), group_name, world)
    by_rank = need.view(world, world, per_rank)  # [receiver, owner, block of the owner]
    sees = by_rank.any(-1)
    offsets = [0] + [d for d in range(1, world)
                     if any(bool(sees[r, (r - d) % world]) for r in range(world))]
    device = block_mask.kv_num_blocks.device
    steps = []
    for d in offsets:
        src, dst = (rank - d) % world, (rank + d) % world
        recv = by_rank[rank, src].nonzero().flatten()
        send = by_rank[dst, rank].nonzero().flatten()
        cols = (torch.arange(per_rank) if d == 0 else recv) + src * per_rank
        rows = _rows(cols.to(device), kb)
        kv_pos = positions[:, rows]
        mask, q_rows, step_q_pos = None, (0, q_len), q_pos
        if recv.numel():
            pick = cols.to(device)
            p, f = partial[..., pick], full[..., pick]
            first, end = _seeing_blocks(p | f)
            q_rows = (first * qb, min(end * qb, q_len))
            if q_rows != (0, q_len):
                # Their own storage (the step's mask_mod and score_mod hold it).
                step_q_pos = q_pos[:, q_rows[0]:q_rows[1]].clone()
            p, f = p[..., first:end, :], f[..., first:end, :]
            mask = BlockMask.from_kv_blocks(
                *_ordered(p), *_ordered(f), BLOCK_SIZE=(qb, kb),
                mask_mod=positions_mod(mask_mod, step_q_pos, kv_pos, score=False),
                seq_lengths=(q_rows[1] - q_rows[0], rows.numel()))
        send_index = None
        if d and 0 < send.numel() < per_rank:
            send_index = _rows(send.to(device), kb)
        steps.append(RingStep(d, src, dst, 0 if d == 0 else rows.numel(),
                              0 if d == 0 else send.numel() * kb, send_index,
                              bool(recv.numel()), mask, kv_pos, q_rows, step_q_pos))
    digest = zlib.crc32(need.numpy().tobytes(), zlib.crc32(repr((world, q_len, kv_len, qb, kb))
                                                           .encode()))
    return FlexShard(group_name, world, rank, q_len, kv_len, (qb, kb), q_pos, positions,
                     tuple(steps), digest)


def dense_shard(group_name: str, world: int, rank: int, q_len: int, device: torch.device,
                positions: torch.Tensor | None = None) -> FlexShard:
    """The plan without a BlockMask (every query sees every key): every
    rank's whole shard. ``positions`` ``(1|B, S)``: the original position of
    each row of the sharded (load-balancer rearranged) sequence; None: the
    sequence was sharded in order."""
    if positions is None:
        positions = torch.arange(world * q_len, device=device).unsqueeze(0)
    positions = positions.to(device)

    def rows(r: int) -> torch.Tensor:
        return positions[:, r * q_len:(r + 1) * q_len]

    steps = tuple(
        RingStep(d, (rank - d) % world, (rank + d) % world, q_len if d else 0,
                 q_len if d else 0, None, True, None, rows((rank - d) % world),
                 (0, q_len), rows(rank))
        for d in range(world))
    return FlexShard(group_name, world, rank, q_len, world * q_len, (q_len, q_len),
                     rows(rank), positions, steps, world)
