"""Convolution of an input sharded along a spatial dim (``cplib_c::tp_convolution``):
fake kernels, autograd, the functional ``tp_conv`` and the DTensor handlers.

Layout. Rank ``r`` of the group holds a contiguous slice of the full input
along ``dim``. With stride 1 along ``dim``, padding ``p``, kernel ``k`` and
dilation ``d``, a window spans ``halo + 1`` columns, ``halo = d * (k - 1)``,
split as ``lh = halo // 2`` columns on the left and ``rh = halo - lh`` on the
right. Output column ``o`` belongs to the rank that holds input column
``o - p + lh``; the first rank also owns the columns before the input, the
last rank those after it. So a "same" convolution (``2p == halo``) is sharded
exactly like its input, and the ranks' outputs concatenated along ``dim`` are
the full convolution's output. Each rank receives ``lh``/``rh`` halo columns
from its neighbours and zero-pads only at the global borders. A stride ``s > 1``
along ``dim`` is supported when windows tile the input (``s`` equals the
kernel span ``d*(k-1)+1``, padding 0): every local width must then be a
multiple of ``s`` and no exchange is needed. Sharding the batch dim (0) needs
no exchange at all, whatever the parameters. (How a rank computes its columns
- convolving its input in place and patching the border columns, or one
extended copy - is described in csrc/torch/conv/tp_conv_impl.h and the README.)

Gradients. ``grad_input`` is exact: halo gradients are sent back and added to
the neighbours' borders. ``grad_weight`` and ``grad_bias`` are this rank's
**partial sums** (over its own output columns); the full gradient is their sum
over the group, so the caller must ``all_reduce(SUM)`` them over the shard
group (DDP/FSDP do this for batch-sharded data anyway). The DTensor path
(``enable_dtensor_conv``) does that all-reduce itself, so module parameter
gradients are exact there.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from ..attention.args import check_inputs
from ..comm.handshake import agreed
from ..comm.native import (GroupLike, group_name_of, group_size, normalize_dim, ops,
                           reject_real_in_fake)

__all__ = ["tp_conv"]

IntOrSeq = int | Sequence[int]


# ---------------------------------------------------------------- layout (mirrors tp_conv_plan.cpp)


def _per_dim(v: Sequence[int], n: int, name: str, min_value: int) -> list[int]:
    v = list(v)
    if len(v) not in (1, n):
        raise ValueError(f"cplib.tp_conv: {name}={v} must have 1 or {n} entries for a {n}-d "
                         "convolution")
    out = v * n if len(v) == 1 else v
    if any(e < min_value for e in out):
        raise ValueError(f"cplib.tp_conv: {name}={v} must be >= {min_value}")
    return out


def _local_out_shape(x_shape: Sequence[int], w_shape: Sequence[int], stride: Sequence[int],
                     padding: Sequence[int], dilation: Sequence[int], groups: int,
                     shard_dim: int, rank: int, size: int) -> list[int]:
    """Shape of rank ``rank``'s output; raises like the native op would."""
    nd = len(x_shape)
    if not 3 <= nd <= 5:
        raise ValueError("cplib.tp_conv: x must be 3-D, 4-D or 5-D (batch, channels, spatial...), "
                         f"got shape {tuple(x_shape)}")
    if len(w_shape) != nd:
        raise ValueError(f"cplib.tp_conv: weight must have {nd} dimensions like x, got shape "
                         f"{tuple(w_shape)}")
    if groups < 1:
        raise ValueError(f"cplib.tp_conv: groups={groups} must be >= 1")
    if w_shape[0] % groups != 0 or x_shape[1] != w_shape[1] * groups:
        raise ValueError(f"cplib.tp_conv: groups={groups} does not fit x channels {x_shape[1]} "
                         f"and weight shape {tuple(w_shape)}")
    nsp = nd - 2
    s = _per_dim(stride, nsp, "stride", 1)
    p = _per_dim(padding, nsp, "padding", 0)
    dl = _per_dim(dilation, nsp, "dilation", 1)
    dim = normalize_dim(shard_dim, nd, "shard_dim")
    if dim == 1:
        raise NotImplementedError(
            f"cplib.tp_conv: shard_dim={shard_dim} is the channel dim; shard the batch dim (0) "
            f"or a spatial dim (2..{nd - 1})")
    spans = [dl[i] * (w_shape[i + 2] - 1) + 1 for i in range(nsp)]
    out = [x_shape[0], w_shape[0]]
    out += [(x_shape[i + 2] + 2 * p[i] - spans[i]) // s[i] + 1 for i in range(nsp)]
    if dim == 0 or size == 1:
        return out
    i = dim - 2
    width, span = x_shape[dim], spans[i]
    if s[i] != 1:
        if p[i] != 0 or span != s[i]:
            raise NotImplementedError(
                f"cplib.tp_conv: stride={s[i]} along shard_dim={dim} is supported only when it "
                f"equals the kernel span dilation*(kernel-1)+1 ({span}) and padding along that "
                f"dim is 0 (got padding={p[i]})")
        if width % s[i] != 0:
            raise ValueError(f"cplib.tp_conv: local width {width} along shard_dim={dim} must be "
                             f"a multiple of stride={s[i]} so that shards hold whole windows")
        return out
    halo = span - 1
    if halo == 0 and p[i] == 0:
        return out
    lh, rh = halo // 2, halo - halo // 2
    first, last = rank == 0, rank == size - 1
    send = max(0 if first else rh, 0 if last else lh)
    if width < send:
        raise ValueError(f"cplib.tp_conv: local width {width} along shard_dim={dim} on rank "
                         f"{rank} is smaller than the halo its neighbours need ({send} = part of "
                         f"dilation*(kernel-1) = {halo})")
    ext = (p[i] if first else lh) + width + (p[i] if last else rh)
    if ext < span:
        raise ValueError(f"cplib.tp_conv: local width {width} along shard_dim={dim} on rank "
                         f"{rank} leaves no output column for kernel span {span}")
    out[dim] = ext - span + 1
    return out


def _group_rank(group_name: str) -> int:
    # Reads the rank only (no communication): the output width of the first
    # and last rank differs when the convolution is not "same".
    return dist.distributed_c10d._resolve_process_group(group_name).rank()


# ---------------------------------------------------------------- fake kernels and autograd


@torch.library.register_fake("cplib_c::tp_convolution")
def _tp_convolution_fake(x, w, b, stride, padding, dilation, groups, shard_dim, group_name):
    reject_real_in_fake("tp_conv", x, w, b)
    size = group_size(group_name)
    shape = _local_out_shape(x.shape, w.shape, stride, padding, dilation, groups, shard_dim,
                             _group_rank(group_name), size)
    return x.new_empty(shape)


@torch.library.register_fake("cplib_c::tp_convolution_backward")
def _tp_convolution_backward_fake(grad_out, x, w, stride, padding, dilation, groups, shard_dim,
                                  group_name, output_mask):
    reject_real_in_fake("tp_conv", grad_out, x, w)
    size = group_size(group_name)
    _local_out_shape(x.shape, w.shape, stride, padding, dilation, groups, shard_dim,
                     _group_rank(group_name), size)
    gi = x.new_empty(x.shape) if output_mask[0] else None
    gw = w.new_empty(w.shape) if output_mask[1] else None
    gb = w.new_empty((w.shape[0],)) if output_mask[2] else None
    return gi, gw, gb


torch.library.register_fake("cplib_c::tp_convolution_backward_covered",
                            _tp_convolution_backward_fake)


def _setup(ctx, inputs, output):
    x, w, b, stride, padding, dilation, groups, shard_dim, group_name = inputs
    ctx.save_for_backward(x, w)
    ctx.args = (stride, padding, dilation, groups, shard_dim, group_name)
    ctx.has_bias = b is not None


def _backward(ctx, grad_out):
    x, w = ctx.saved_tensors
    need = ctx.needs_input_grad
    mask = [need[0], need[1], ctx.has_bias and need[2]]
    # Covered by the forward's handshake: none of its own (one per fwd+bwd).
    gi, gw, gb = ops.tp_convolution_backward_covered(grad_out.contiguous(), x, w, *ctx.args,
                                                     mask)
    return gi, gw, gb, None, None, None, None, None, None


torch.library.register_autograd("cplib_c::tp_convolution", _backward, setup_context=_setup)


# ---------------------------------------------------------------- functional API


def _as_list(v: IntOrSeq, what: str) -> list[int]:
    """An int or a sequence of ints as a list; anything else (floats,
    tensors, strings) is a ValueError naming the argument."""
    items = [v] if isinstance(v, int) else list(v) if isinstance(v, (list, tuple)) else None
    if items is None or any(isinstance(e, bool) or not isinstance(e, int) for e in items):
        raise ValueError(f"cplib.tp_conv: {what}={v!r} must be an int or a sequence of ints")
    return items


def tp_conv(
    x_local: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: IntOrSeq = 1,
    padding: IntOrSeq = 0,
    dilation: IntOrSeq = 1,
    groups: int = 1,
    dim: int = -1,
    group: GroupLike | None = None,
) -> torch.Tensor:
    """Convolution (1-D, 2-D or 3-D, like ``F.conv{1,2,3}d``) of an input
    sharded along ``dim`` over ``group`` (a ProcessGroup or its name; default
    the world group). ``x_local`` is this rank's slice of the full input (rank
    order = slice order); the result is this rank's slice of the full output,
    as described in the module docstring.

    Backward: ``x_local.grad`` is exact; ``weight.grad`` and ``bias.grad`` are
    this rank's partial sums and must be all-reduced (SUM) over ``group`` to
    equal the full convolution's gradients.
    """
    name = group_name_of(group if group is not None else dist.group.WORLD)

    def check():
        check_inputs("tp_conv", x_local=x_local, weight=weight,
                     **({} if bias is None else {"bias": bias}))
        if isinstance(padding, str):
            raise ValueError(f"cplib.tp_conv: padding={padding!r} is not supported; pass "
                             "integers")
        for what, value in (("groups", groups), ("dim", dim)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"cplib.tp_conv: {what} must be an int, got {value!r}")
        return [_as_list(v, what) for v, what in ((stride, "stride"), (padding, "padding"),
                                                  (dilation, "dilation"))]

    args = agreed("tp_conv", name, (x_local, weight, bias), check)
    return ops.tp_convolution(x_local, weight, bias, *args, groups, dim, name)

