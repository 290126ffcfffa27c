"""The Python mirror of the ring's argument checks (check_args in
csrc/torch/ring/ring_args.cpp), run by the fake kernels so that traced code
fails as the native op does, and by Ulysses' local checks."""

from __future__ import annotations

import math

from ..attention.args import DTYPES, check_positions
from ..attention.names import BACKENDS, LAYOUTS, RING_PASSES, ROTATIONS, Layout
from ..comm.native import group_size
from .args import check_extras
from .call import RingCall

__all__ = ["check_call"]


def check_call(op: str, q, k, v, call: RingCall) -> None:
    # Mirrors check_args in csrc/torch/ring/ring_args.cpp so traced code fails the same way.
    for what, value, names in (("layout", call.layout, LAYOUTS),
                               ("backend", call.backend, BACKENDS),
                               ("rotate", call.rotate, ROTATIONS),
                               ("ring_pass", call.ring_pass, RING_PASSES)):
        if value not in names:
            raise ValueError(f"cplib.{op}: {what}={value!r} is not one of "
                             f"{', '.join(map(repr, names))}")
    group_name, backend, scale = call.group_name, call.backend, call.scale
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"cplib.{op}: expected q, k, v of shape (B, H, S_local, D), got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"cplib.{op}: q, k, v must be on one device, got {q.device}, "
                         f"{k.device}, {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"cplib.{op}: q, k, v must have one dtype, got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")
    if q.dtype not in DTYPES:
        raise ValueError(f"cplib.{op}: unsupported dtype {q.dtype} "
                         "(expected float32, float64, bfloat16 or float16)")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"cplib.{op}: batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, "
                         f"v {v.shape[0]}")
    if q.shape[0] == 0:
        raise ValueError(f"cplib.{op}: empty batch (q has shape {tuple(q.shape)})")
    if k.shape[1:3] != v.shape[1:3]:
        raise ValueError(f"cplib.{op}: k {tuple(k.shape)} and v {tuple(v.shape)} must agree in "
                         "heads and length")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"cplib.{op}: q head dim {q.shape[3]} differs from k head dim "
                         f"{k.shape[3]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"cplib.{op}: q has {q.shape[1]} heads, which is not a multiple of "
                         f"k/v's {k.shape[1]} heads")
    positions = call.has_positions
    if (q.shape[2] == 0 or k.shape[2] == 0) and not positions:
        raise ValueError(f"cplib.{op}: empty local sequence (q length {q.shape[2]}, kv length "
                         f"{k.shape[2]})")
    if q.shape[3] == 0 or v.shape[3] == 0:
        raise ValueError(f"cplib.{op}: empty head dim")
    if q.device.type not in ("cuda", "cpu", "meta"):
        raise ValueError(f"cplib.{op}: unsupported device {q.device}")
    if q.device.type != "cuda" and backend not in ("auto", "flash"):
        raise ValueError(f"cplib.{op}: backend={backend!r} needs CUDA; CPU tensors always use "
                         "'flash'")
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"cplib.{op}: scale={scale} must be a finite positive number or None")
    window = call.window
    if positions:
        check_positions(op, "q_positions", call.q_positions, q.shape[2], "q")
        check_positions(op, "kv_positions", call.kv_positions, k.shape[2], "k/v")
        if call.layout != Layout.SEQUENTIAL or call.seq_len is not None:
            raise ValueError(f"cplib.{op}: q_positions/kv_positions describe the layout "
                             f"themselves: they exclude seq_len and layout={call.layout!r} "
                             "(load_balanced, per_document and placement)")
        if group_name is not None:
            group_size(group_name)
        if window is not None and len(list(window)) != 2:
            raise ValueError(f"cplib.{op}: window must be (left, right), got {list(window)}")
        if window is not None and min(window) < 0:
            raise ValueError(f"cplib.{op}: window={list(window)} must be non-negative "
                             "(None for no limit)")
        return
    if call.is_causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"cplib.{op}: is_causal needs equal local q and kv lengths, got q "
                         f"{q.shape[2]} and kv {k.shape[2]}")
    if call.seq_len is None and call.layout == Layout.HEAD_TAIL and (q.shape[2] % 2 or
                                                                      k.shape[2] % 2):
        raise ValueError(f"cplib.{op}: load_balanced needs even local lengths (two chunks per "
                         f"rank), got q {q.shape[2]} and kv {k.shape[2]}")
    if group_name is None:  # a world-of-one check (cplib/ulysses/args.py)
        return
    group_size(group_name)  # ValueError for an unknown group
    check_extras(op, q, k, call)

