"""BlockMask rewriting for flex-attention context parallelism.

Under CP each rank keeps a contiguous slice of the (possibly load-balanced,
i.e. rearranged) query sequence and attends to the all-gathered K/V, which
arrive in the same rearranged order. The user's ``mask_mod`` is written for
original (global, unrearranged) positions, so the local BlockMask is built
from a wrapper that maps

* a local query index ``q`` to the rearranged position ``rank * Q_SHARD + q``
  and then, through the load balancer's rearrange indices, to its original
  position;
* a gathered KV index (already a rearranged position) to its original one.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from ..comm.native import check_mesh

__all__ = ["_create_cp_block_mask", "shard_block_mask", "DEFAULT_BLOCK_SIZE"]

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# Default sparse block size (torch's); every function takes it as a parameter
# because other kernels (FlashAttention-4 on Blackwell) need other sizes.
DEFAULT_BLOCK_SIZE = 128


@functools.cache
def _compiled_create_block_mask() -> Callable[..., BlockMask]:
    """One compiled ``create_block_mask`` per process, shared by every call
    (dynamo caches one graph per mask_mod code and shape)."""
    return torch.compile(create_block_mask, dynamic=False, fullgraph=True)


def _block_sizes(block_size: int | tuple[int, int]) -> tuple[int, int]:
    sizes = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
    if len(sizes) != 2 or not all(isinstance(s, int) and s > 0 for s in sizes):
        raise ValueError(
            f"cplib: block_size must be a positive int or a pair of them, got {block_size!r}"
        )
    return sizes  # type: ignore[return-value]


def _rearrange_indices(load_balancer: Any, B: int, seq_len: int,
                       device: torch.device | str) -> torch.Tensor | None:
    """The balancer's ``(1 | B, S)`` rearrange indices, checked against the mask."""
    if load_balancer is None:
        return None
    idx = load_balancer._generate_indices(restore=False)
    if idx is None:
        return None
    if idx.ndim != 2 or idx.size(0) not in (1, B) or idx.size(1) != seq_len:
        raise ValueError(
            f"cplib: load balancer indices have shape {tuple(idx.shape)}, expected "
            f"(1, {seq_len}) or ({B}, {seq_len}) for a mask with B={B} and sequence length "
            f"{seq_len}"
        )
    return idx.to(device=device, dtype=torch.int64)


def _rewrite_mask_mod(mask_mod: MaskMod, q_offset: int,
                      indices: torch.Tensor | None) -> MaskMod:
    """Wraps ``mask_mod`` (global positions) into the local-query mask_mod."""
    if indices is None:
        def cp_mask_mod(b, h, q_idx, kv_idx):
            return mask_mod(b, h, q_idx + q_offset, kv_idx)
    elif indices.size(0) == 1:
        row = indices[0]

        def cp_mask_mod(b, h, q_idx, kv_idx):
            return mask_mod(b, h, row[q_idx + q_offset], row[kv_idx])
    else:
        def cp_mask_mod(b, h, q_idx, kv_idx):
            return mask_mod(b, h, indices[b, q_idx + q_offset], indices[b, kv_idx])
    return cp_mask_mod


def _create_cp_block_mask(
    mask_mod: MaskMod,
    B: int,
    H: int,
    Q_LEN: int,
    KV_LEN: int,
    device_mesh: DeviceMesh,
    load_balancer: Any = None,
    block_size: int | tuple[int, int] = DEFAULT_BLOCK_SIZE,
) -> BlockMask:
    """BlockMask for this rank's query shard against the all-gathered K/V.

    Args:
        mask_mod: mask function on global (original) positions.
        B, H: batch size and heads of the mask (H=1 broadcasts over heads).
        Q_LEN, KV_LEN: global query and key/value lengths.
        device_mesh: 1-D CP mesh; the mask is built on its device type.
        load_balancer: the ``_LoadBalancer`` that rearranged Q/K/V before
            sharding, or None when they were sharded in order. (torch falls back
            to its global ``enable_load_balance`` option here; cplib takes the
            balancer explicitly, as ``_context_parallel_shard`` does.)
        block_size: sparse block size, int or (q, kv); default 128.

    The mask is built by one process-wide compiled ``create_block_mask``
    (``torch.compiler.set_stance("force_eager")`` builds it eagerly).

    Raises:
        NotImplementedError: ``Q_LEN`` is not divisible by world size * Q block
            size (the local mask could not be built without padding), or the
            load balancer cannot rearrange this length.
        ValueError: bad block size, mesh or balancer indices.
    """
    q_block, kv_block = _block_sizes(block_size)
    check_mesh(device_mesh)
    rank, world = device_mesh.get_local_rank(), device_mesh.size()
    if Q_LEN % (world * q_block) != 0:
        raise NotImplementedError(
            f"Q_LEN {Q_LEN} is not divisible by CP mesh world size {world} * "
            f"BLOCK_SIZE {q_block}. This is not supported yet."
        )
    device = device_mesh.device_type
    indices = _rearrange_indices(load_balancer, B, Q_LEN, device)
    if indices is not None and KV_LEN != Q_LEN:
        raise ValueError(
            f"cplib: a load balancer rearranges queries and keys alike, so KV_LEN ({KV_LEN}) "
            f"must equal Q_LEN ({Q_LEN})"
        )
    q_shard = Q_LEN // world
    mask = _compiled_create_block_mask()(
        _rewrite_mask_mod(mask_mod, rank * q_shard, indices),
        B, H, q_shard, KV_LEN,
        device=device,
        BLOCK_SIZE=(q_block, kv_block),
    )
    # is_dynamo_compiling: is_compiling() is also true while another thread (a
    # rank of the threaded group) compiles.
    if not torch.compiler.is_dynamo_compiling():  # the plan's all-gather runs eagerly only
        _attach_plan(mask, mask_mod, device_mesh, indices, Q_LEN, KV_LEN, q_shard)
    return mask


def _attach_plan(mask: BlockMask, mask_mod: MaskMod, mesh: DeviceMesh,
                 indices: torch.Tensor | None, q_len: int, kv_len: int, q_shard: int) -> None:
    """Records on ``mask`` its shard's layout and flex-ring plan (plan.py)."""
    from ..comm.handshake import handshake
    from .plan import SHARD_ATTR, plan_shard
    from .stand_in import stand_in_for

    group = check_mesh(mesh)
    rank, world = mesh.get_local_rank(), mesh.size()
    device = mask.kv_num_blocks.device
    qb, kb = mask.BLOCK_SIZE
    # Every rank made its mask alike before the plan's all-gather (or all raise).
    handshake(group.group_name, "create_cp_block_mask", fields={
        "Q_LEN": q_len, "KV_LEN": kv_len, "B": mask.kv_num_blocks.shape[0],
        "H": mask.kv_num_blocks.shape[1], "BLOCK_SIZE[0]": qb, "BLOCK_SIZE[1]": kb,
        "load balanced": int(indices is not None)})
    if indices is None:
        q_pos = torch.arange(rank * q_shard, (rank + 1) * q_shard, device=device).unsqueeze(0)
        positions = torch.arange(kv_len, device=device).unsqueeze(0)
    else:
        q_pos, positions = indices[:, rank * q_shard:(rank + 1) * q_shard], indices
    setattr(mask, SHARD_ATTR,
            plan_shard(mask, mask_mod, group.group_name, world, rank, q_pos, positions))
    stand_in_for(mask)  # made now: a compiled module's forward finds it


def shard_block_mask(device_mesh: DeviceMesh, block_mask: BlockMask,
                      load_balancer: Any = None) -> BlockMask:
    """This rank's shard of a full-sequence BlockMask (what
    ``_context_parallel_shard`` returns for a BlockMask buffer). It keeps the
    mask's own block size, so masks built for other kernels shard as they are."""
    B, H = block_mask.kv_num_blocks.shape[:2]
    q_len, kv_len = block_mask.seq_lengths
    return _create_cp_block_mask(
        block_mask.mask_mod, B, H, q_len, kv_len, device_mesh, load_balancer,
        block_size=tuple(block_mask.BLOCK_SIZE),
    )
