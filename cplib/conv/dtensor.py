"""DTensor handlers that route ``aten.convolution`` / ``aten.convolution_backward``
on DTensor inputs sharded along a spatial dim to ``cplib_c::tp_convolution``.

Opt-in: ``cplib.enable_dtensor_conv()`` swaps torch's handlers (the upstream
``_tp_conv`` prototype) for these; ``cplib.disable_dtensor_conv()`` restores
them. Importing cplib changes nothing in DTensor.

Supported placements of the input on its mesh: ``Replicate`` or ``Shard(d)``
per mesh dim with at most one mesh dim sharding a spatial dim ``d >= 2`` (the
exchange runs over that mesh dim's group, ranks as the mesh orders them), and
the others sharding the batch dim or replicating. Weight and bias must be
replicated. The output has the input's placements. Backward all-reduces
``grad_weight`` / ``grad_bias`` over every mesh dim that shards the input, so
the parameters' gradients are exact and replicated.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from ..comm.native import ops
from .. import patch_registry as registry
from .tp_conv import _local_out_shape

__all__ = ["enable_dtensor_conv", "disable_dtensor_conv"]

aten = torch.ops.aten
_OPS = (aten.convolution.default, aten.convolution_backward.default)
# The registry's owner of the handlers enable_dtensor_conv() puts in DTensor's table.
OWNER = "dtensor_conv"


def _contiguous_stride(shape: list[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def _chunk_sizes(length: int, n: int) -> list[int]:
    # DTensor's Shard placement splits like torch.chunk.
    c = -(-length // n)
    return [max(0, min(c, length - i * c)) for i in range(n)]


def _replicated_local(t: Any, what: str) -> torch.Tensor | None:
    if t is None or not isinstance(t, DTensor):
        return t
    if not all(isinstance(p, Replicate) for p in t.placements):
        raise NotImplementedError(f"cplib DTensor conv: {what} must be replicated, got "
                                  f"placements {t.placements}")
    return t.to_local()


def _shard_layout(x: DTensor) -> tuple[int | None, int]:
    """(mesh dim that shards a spatial dim or None, that tensor dim or 0)."""
    found: tuple[int | None, int] = (None, 0)
    for mesh_dim, p in enumerate(x.placements):
        if isinstance(p, Replicate):
            continue
        if not isinstance(p, Shard):
            raise NotImplementedError(f"cplib DTensor conv: input placement {p} on mesh dim "
                                      f"{mesh_dim} is not supported (Shard or Replicate only)")
        d = p.dim % x.ndim
        if d == 1:
            raise NotImplementedError("cplib DTensor conv: sharding the channel dim (Shard(1)) "
                                      "is not supported")
        if d >= 2:
            if found[0] is not None:
                raise NotImplementedError("cplib DTensor conv: at most one mesh dim may shard a "
                                          f"spatial dim, got placements {x.placements}")
            found = (mesh_dim, d)
    return found


def _check_layout_matches(x: DTensor, w_shape, stride, padding, dilation, groups, mesh_dim, dim,
                          out_global: list[int]) -> None:
    """Every rank checks every rank of the shard group (all know the global
    shapes), so an unsupported layout raises everywhere before any exchange."""
    n = x.device_mesh.size(mesh_dim)
    in_sizes = _chunk_sizes(x.shape[dim], n)
    want = _chunk_sizes(out_global[dim], n)
    for r in range(n):
        shape = list(x.shape)
        shape[dim] = in_sizes[r]
        got = _local_out_shape(shape, w_shape, stride, padding, dilation, groups, dim, r, n)[dim]
        if got != want[r]:
            raise NotImplementedError(
                f"cplib DTensor conv: with padding={list(padding)} the output of rank {r} along "
                f"dim {dim} would hold {got} columns but DTensor's Shard({dim}) layout of the "
                f"{out_global[dim]}-wide output puts {want[r]} there; use 'same' padding "
                "(2*padding == dilation*(kernel-1)) or call cplib.tp_conv directly")


def _spec_like(x: DTensor, shape: list[int], placements) -> DTensorSpec:
    meta = TensorMeta(torch.Size(shape), _contiguous_stride(shape), x.dtype)
    return DTensorSpec(x.device_mesh, tuple(placements), tensor_meta=meta)


def _convolution_handler(op_call, args, kwargs) -> object:
    x, w, b, stride, padding, dilation, transposed, output_padding, groups = args
    if transposed:
        raise NotImplementedError("cplib DTensor conv: transposed convolution is not supported")
    w_local = _replicated_local(w, "weight")
    b_local = _replicated_local(b, "bias")
    mesh_dim, dim = _shard_layout(x)
    nsp = x.ndim - 2
    full = _local_out_shape(x.shape, w_local.shape, stride, padding, dilation, groups, 0, 0, 1)
    x_local = x.to_local()
    if mesh_dim is None:  # batch-sharded or replicated: every window is local
        out = op_call(x_local, w_local, b_local, stride, padding, dilation, False,
                      [0] * nsp, groups)
    else:
        _check_layout_matches(x, w_local.shape, stride, padding, dilation, groups, mesh_dim, dim,
                              full)
        name = x.device_mesh.get_group(mesh_dim).group_name
        out = ops.tp_convolution(x_local, w_local, b_local, list(stride), list(padding),
                                 list(dilation), groups, dim, name)
    return DTensor(out, _spec_like(x, full, x.placements), requires_grad=False)


def _convolution_backward_handler(op_call, args, kwargs) -> object:
    (grad_out, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding, groups,
     output_mask) = args
    if transposed:
        raise NotImplementedError("cplib DTensor conv: transposed convolution is not supported")
    w_local = _replicated_local(w, "weight")
    if grad_out.placements != x.placements:
        grad_out = grad_out.redistribute(x.device_mesh, x.placements)
    mesh_dim, dim = _shard_layout(x)
    mask = [bool(output_mask[0]), bool(output_mask[1]), bool(output_mask[2])]
    if mesh_dim is None:
        gi, gw, gb = op_call(grad_out.to_local(), x.to_local(), w_local, bias_sizes, stride,
                             padding, dilation, False, output_padding, groups, mask)
    else:
        name = x.device_mesh.get_group(mesh_dim).group_name
        gi, gw, gb = ops.tp_convolution_backward(grad_out.to_local(), x.to_local(), w_local,
                                                 list(stride), list(padding), list(dilation),
                                                 groups, dim, name, mask)
    # Partial sums over every mesh dim that shards the input -> exact, replicated.
    sharded = [i for i, p in enumerate(x.placements) if isinstance(p, Shard)]
    for t in (gw, gb):
        if t is not None:
            for i in sharded:
                dist.all_reduce(t, group=x.device_mesh.get_group(i))
    rep = [Replicate()] * x.device_mesh.ndim
    return (
        None if gi is None else DTensor(gi, _spec_like(x, list(x.shape), x.placements),
                                        requires_grad=False),
        None if gw is None else DTensor(gw, _spec_like(x, list(w.shape), rep), requires_grad=False),
        None if gb is None else DTensor(gb, _spec_like(x, [w.shape[0]], rep), requires_grad=False),
    )


def _dispatcher():
    return DTensor._op_dispatcher


def enable_dtensor_conv() -> None:
    """Routes convolutions on DTensor inputs to cplib's halo-exchange op
    (replacing torch's ``_tp_conv`` handlers, through cplib's patch
    registry) until ``disable_dtensor_conv``."""
    handlers = _dispatcher()._custom_op_handlers
    for op, fn in zip(_OPS, (_convolution_handler, _convolution_backward_handler)):
        registry.replace(OWNER, handlers, op, lambda _, fn=fn: fn)


def disable_dtensor_conv() -> None:
    """Restores the handlers that were active before ``enable_dtensor_conv``."""
    registry.restore(OWNER)
