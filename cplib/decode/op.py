"""``decode_sdpa``: attention of the newest tokens (replicated on every rank)
against a KV cache sharded over a process group (``cplib_c::decode_sdpa``,
csrc/torch/decode/), and its fake kernel."""

from __future__ import annotations

import math

import torch

from ..attention.args import (DTYPES, acc_dtype, check_inputs, check_positions, scale_arg,
                              window_arg)
from ..comm.handshake import agreed
from ..comm.native import GroupLike, group_name_of, group_size, ops, reject_real_in_fake

__all__ = ["decode_sdpa"]


def _check_given_positions(name: str, pos, rows: int, rows_of: str) -> None:
    if pos is not None:  # the pairing of the two is checked by the caller
        check_positions("decode_sdpa", name, pos, rows, rows_of)


def _check(q, k, v, group_name, q_positions, kv_positions, window, scale) -> None:
    # Mirrors check_args in csrc/torch/decode/decode_op.cpp.
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("cplib.decode_sdpa: expected q (B, Hq, T, D) and k, v (B, Hkv, L_local, "
                         f"D), got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if not (q.device == k.device == v.device):
        raise ValueError("cplib.decode_sdpa: q, k, v must be on one device")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"cplib.decode_sdpa: q, k, v must have one dtype, got {q.dtype}, "
                         f"{k.dtype}, {v.dtype}")
    if q.dtype not in DTYPES:
        raise ValueError(f"cplib.decode_sdpa: unsupported dtype {q.dtype}")
    if q.shape[2] < 1:
        raise ValueError(f"cplib.decode_sdpa: q needs at least one token, got T = {q.shape[2]}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"cplib.decode_sdpa: batch sizes differ: q {q.shape[0]}, k "
                         f"{k.shape[0]}, v {v.shape[0]}")
    if k.shape[1:3] != v.shape[1:3]:
        raise ValueError(f"cplib.decode_sdpa: k {tuple(k.shape)} and v {tuple(v.shape)} must "
                         "agree in heads and length")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"cplib.decode_sdpa: q head dim {q.shape[3]} differs from k head dim "
                         f"{k.shape[3]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"cplib.decode_sdpa: q has {q.shape[1]} heads, which is not a multiple "
                         f"of k/v's {k.shape[1]} heads")
    if (q_positions is None) != (kv_positions is None):
        missing = "q_positions" if q_positions is None else "kv_positions"
        raise ValueError(f"cplib.decode_sdpa: {missing} is missing: give q_positions and "
                         "kv_positions together, or neither")
    _check_given_positions("q_positions", q_positions, q.shape[2], "q")
    _check_given_positions("kv_positions", kv_positions, k.shape[2], "k/v")
    if window is not None and q_positions is None:
        raise ValueError("cplib.decode_sdpa: window needs q_positions and kv_positions")
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"cplib.decode_sdpa: scale={scale} must be a finite positive number or "
                         "None")
    group_size(group_name)


@torch.library.register_fake("cplib_c::decode_sdpa")
def _decode_sdpa_fake(q, k, v, group_name, q_positions=None, kv_positions=None, window=None,
                      scale=None):
    reject_real_in_fake("decode_sdpa", q, k, v, q_positions, kv_positions)
    _check(q, k, v, group_name, q_positions, kv_positions, window, scale)
    b, h, t, _ = q.shape
    out = q.new_empty((b, h, t, v.shape[3]))
    lse = q.new_empty((b, h, t), dtype=acc_dtype(q.dtype))
    return out, lse


def decode_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: GroupLike,
    *,
    q_positions: torch.Tensor | None = None,
    kv_positions: torch.Tensor | None = None,
    window: int | tuple[int | None, int | None] | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the newest ``T >= 1`` tokens ``q`` (B, Hq, T, D), the same
    on every rank, against this rank's shard ``k``/``v`` (B, Hkv, L_local, D)
    of a KV cache sharded over ``group`` in any order (L_local may be 0).

    Returns ``(out, lse)`` like :func:`cplib.ring_sdpa`, exact and bitwise the
    same on every rank. With ``q_positions`` (T) and ``kv_positions``
    (L_local), the global positions of the rows, query i sees key j iff
    ``kv_pos[j] <= q_pos[i]`` (causal: speculative multi-token decode), and
    with ``window`` (``w`` or ``(left, right)``; right is 0 under the causal
    mask) also ``kv_pos[j] >= q_pos[i] - left``. Without positions every
    query sees every key. GQA: Hq a multiple of Hkv. It costs one all-gather
    of B*Hq*T*(Dv+1) values of the accumulator dtype, after the handshake
    (which raises ValueError on every rank when q differs between ranks).
    Forward only."""
    name = group_name_of(group)

    def args():
        check_inputs("decode_sdpa", q=q, k=k, v=v, q_positions=q_positions,
                     kv_positions=kv_positions)
        return window_arg(window), scale_arg("decode_sdpa", scale)

    window_sides, scale = agreed("decode_sdpa", name, (q, k, v), args)
    return ops.decode_sdpa(q, k, v, name, q_positions, kv_positions, window_sides, scale)
