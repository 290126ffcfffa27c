"""Fake kernels and autograd for ``cplib_c::flex_cp_allgather`` (and its
reduce-scatter backward), plus the drop-in Python entry point."""

from __future__ import annotations

import torch

from ..attention.args import check_inputs
from ..comm.handshake import agreed
from ..comm.native import (GroupLike, group_name_of, group_size, normalize_dim, ops,
                           reject_real_in_fake)

__all__ = ["flex_cp_allgather"]


def _check_pair(k: torch.Tensor, v: torch.Tensor, dim: int, op: str) -> None:
    # Mirrors check_pair in csrc/torch/flex/allgather.cpp so traced code fails the same way.
    for name, t in (("k", k), ("v", v)):
        if not t.dtype.is_floating_point:
            raise ValueError(f"cplib.{op}: {name} has dtype {t.dtype}; expected a floating "
                             "dtype (float32, float64, bfloat16 or float16)")
    if k.dim() != v.dim():
        raise ValueError(
            f"cplib.{op}: k and v must have the same number of dimensions, "
            f"got k {tuple(k.shape)} and v {tuple(v.shape)}"
        )
    for d in range(k.dim()):
        free = d != dim and k.dim() == 4 and d in (1, 3)
        if not free and k.shape[d] != v.shape[d]:
            raise ValueError(
                f"cplib.{op}: k and v shapes differ in dimension {d} (k {tuple(k.shape)}, "
                f"v {tuple(v.shape)}); only the head and feature dimensions may differ"
            )


def _resized(t: torch.Tensor, dim: int, factor: int, divide: bool) -> torch.Tensor:
    shape = list(t.shape)
    shape[dim] = shape[dim] // factor if divide else shape[dim] * factor
    return t.new_empty(shape)


@torch.library.register_fake("cplib_c::flex_cp_allgather")
def _allgather_fake(k, v, seq_dim, group_name):
    reject_real_in_fake("flex_cp_allgather", k, v)
    dim = normalize_dim(seq_dim, k.dim(), "seq_dim")
    _check_pair(k, v, dim, "flex_cp_allgather")
    n = group_size(group_name)
    return _resized(k, dim, n, False), _resized(v, dim, n, False)


@torch.library.register_fake("cplib_c::flex_cp_allgather_backward")
def _allgather_backward_fake(grad_k, grad_v, seq_dim, group_name):
    reject_real_in_fake("flex_cp_allgather_backward", grad_k, grad_v)
    dim = normalize_dim(seq_dim, grad_k.dim(), "seq_dim")
    _check_pair(grad_k, grad_v, dim, "flex_cp_allgather_backward")
    n = group_size(group_name)
    return _resized(grad_k, dim, n, True), _resized(grad_v, dim, n, True)


def _setup(ctx, inputs, output):
    _, _, seq_dim, group_name = inputs
    ctx.seq_dim, ctx.group_name = seq_dim, group_name
    ctx.out_meta = [(o.shape, o.dtype, o.device) for o in output]


def _grads_or_zeros(ctx, grads):
    return [
        g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
        for g, (shape, dtype, device) in zip(grads, ctx.out_meta)
    ]


def _allgather_backward(ctx, grad_k, grad_v):
    gk, gv = _grads_or_zeros(ctx, (grad_k, grad_v))
    # Covered by the forward's handshake: none of its own (one per fwd+bwd).
    dk, dv = ops.flex_cp_allgather_backward_covered(gk, gv, ctx.seq_dim, ctx.group_name)
    return dk, dv, None, None


def _reduce_scatter_backward(ctx, grad_k, grad_v):
    # The adjoint of a sum reduce-scatter is an all-gather (double backward).
    gk, gv = _grads_or_zeros(ctx, (grad_k, grad_v))
    dk, dv = ops.flex_cp_allgather(gk, gv, ctx.seq_dim, ctx.group_name)
    return dk, dv, None, None


torch.library.register_autograd(
    "cplib_c::flex_cp_allgather", _allgather_backward, setup_context=_setup
)
torch.library.register_fake("cplib_c::flex_cp_allgather_backward_covered",
                            _allgather_backward_fake)
for _op in ("cplib_c::flex_cp_allgather_backward", "cplib_c::flex_cp_allgather_backward_covered"):
    torch.library.register_autograd(_op, _reduce_scatter_backward, setup_context=_setup)


def flex_cp_allgather(
    k: torch.Tensor, v: torch.Tensor, seq_dim: int, pg_name: GroupLike
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gathers ``k`` and ``v`` along ``seq_dim`` over the group ``pg_name``.

    Same signature and result as torch's ``flex_cp_allgather``; the backward is
    a sum reduce-scatter, so each rank receives the gradient of its own shard.
    ``k`` and ``v`` may differ in head and feature dimensions (GQA).
    """
    name = group_name_of(pg_name)

    def check():
        check_inputs("flex_cp_allgather", k=k, v=v)
        if isinstance(seq_dim, bool) or not isinstance(seq_dim, int):
            raise ValueError(f"cplib.flex_cp_allgather: seq_dim must be an int, got {seq_dim!r} "
                             f"({type(seq_dim).__name__})")
        _check_pair(k, v, normalize_dim(seq_dim, k.dim(), "seq_dim"), "flex_cp_allgather")

    agreed("flex_cp_allgather", name, (k, v), check)
    return ops.flex_cp_allgather(k, v, seq_dim, name)
