"""SDPA on sequence-sharded DTensors while ``_enable_context_parallel_dispatcher()``
is on, as torch's prototype does it: the fused SDPA kernels' ops reach
DTensor's dispatcher, whose custom handlers cplib sets to its ring.

torchtitan's ``apply_cp_to_forward`` (SDPA) wraps an attention module's q, k,
v as DTensors sharded along the sequence (``Shard(2)`` of (B, H, S, D) once
transposed) and calls ``F.scaled_dot_product_attention`` on them; SDPA
chooses a kernel (on CPU the flash kernel, which torch's prototype has no
handler for) and autograd records that kernel's backward op. Both ops come
here: the forward runs :func:`cplib.ring_sdpa` on the local shards, in the
layout ``_context_parallel_shard`` recorded (head-tail or sequential) and with
``set_rotate_method``'s rotation; the backward runs the ring's backward with
the arguments that same ``ring_sdpa`` call builds. Anything else on DTensors
(other placements, a 2-D mesh, dropout, masks) raises NotImplementedError on
every rank.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode

from ..comm.handshake import agreed
from ..comm.native import check_mesh, ops
from .. import patch_registry as registry
from .options import _cp_options, rotate_method_name
from .shard_layout import check_layout_read
from ..attention.names import layout_of

__all__ = ["enable_dtensor_sdpa", "disable_dtensor_sdpa"]

aten = torch.ops.aten
# The fused kernels' forward and backward ops -> the ring's block kernel
# (None: the op's own choice, the only one on CPU).
_FORWARD = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: None,
    aten._scaled_dot_product_flash_attention.default: "flash",
    aten._scaled_dot_product_efficient_attention.default: "efficient",
    aten._scaled_dot_product_cudnn_attention.default: "cudnn",
}
_BACKWARD = {
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: None,
    aten._scaled_dot_product_flash_attention_backward.default: "flash",
    aten._scaled_dot_product_efficient_attention_backward.default: "efficient",
    aten._scaled_dot_product_cudnn_attention_backward.default: "cudnn",
}
# The registry's owner of the handlers enable_dtensor_sdpa() puts in DTensor's table.
OWNER = "dtensor_sdpa"


def _bound(op: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The op's arguments by schema name, defaults filled in."""
    schema = op._schema.arguments
    named = {a.name: a.default_value for a in schema if a.has_default_value()}
    named.update(zip((a.name for a in schema), args))
    named.update(kwargs)
    return named


def _check(named: dict[str, Any], op: Any) -> Any:
    """The mesh of a call the ring can compute (q, k, v sharded along the
    sequence over one 1-D mesh, no dropout, no mask); NotImplementedError naming
    what else it got."""
    tensors = {n: named[n] for n in ("query", "key", "value")}
    meshes = {t.device_mesh for t in tensors.values() if isinstance(t, DTensor)}
    for name, t in tensors.items():
        placements = t.placements if isinstance(t, DTensor) else "a plain tensor"
        if not isinstance(t, DTensor) or t.device_mesh.ndim != 1 or len(meshes) != 1 or \
                not (isinstance(t.placements[0], Shard) and t.placements[0].dim % t.ndim == 2):
            raise NotImplementedError(
                f"cplib: the context-parallel dispatcher computes {op.__name__} on DTensors "
                f"sharded along the sequence (Shard(2) of (B, H, S, D)) over one 1-D mesh; "
                f"{name} is {placements}")
    if named.get("dropout_p", 0.0):
        raise NotImplementedError(f"cplib: context-parallel SDPA does not support dropout "
                                  f"(dropout_p={named['dropout_p']})")
    for mask in ("attn_mask", "attn_bias"):
        if named.get(mask) is not None:
            raise NotImplementedError(f"cplib: the context-parallel dispatcher takes no {mask} "
                                      "on DTensors (is_causal=True or no mask)")
    (mesh,) = meshes
    check_layout_read(_cp_options.shard_layout,
                      read=layout_of("scaled_dot_product_attention",
                                     _cp_options.enable_load_balance),
                      cu_seqlens=None, world_size=mesh.size(), ulysses_degree=1)
    return mesh


class _BackwardInstead(TorchDispatchMode):
    """Where ``ring_sdpa`` calls the ring's forward op, calls its backward op
    with the same arguments (those after q, k, v but the sinks, as the op's
    registered autograd does) and keeps the gradients."""

    def __init__(self, grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
        super().__init__()
        self.given = (grad_out, out, lse)
        self.grads: tuple[torch.Tensor, ...] | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is not ops.ring_sdpa.default:
            return func(*args, **(kwargs or {}))
        named = _bound(func, args, kwargs or {})
        rest = [named[a.name] for a in func._schema.arguments[3:] if a.name != "sinks"]
        grad_out, out, lse = self.given
        self.grads = ops.ring_sdpa_backward(grad_out, named["q"], named["k"], named["v"], out,
                                            lse, *rest)
        return out, lse


def _ring(named: dict[str, Any], mesh: Any, backend: str | None,
          backward: tuple | None = None) -> tuple:
    """The ring's (out, lse) of the local shards, or with ``backward`` =
    (grad_out, out, lse) its (dq, dk, dv)."""
    from ..ring.op import ring_sdpa  # imported when first needed, as sdpa_dispatch does

    q, k, v = (named[n].to_local() for n in ("query", "key", "value"))
    if q.device.type != "cuda":  # a CUDA kernel's op on CPU tensors: only the tests do that
        backend = None
    kwargs = dict(is_causal=bool(named.get("is_causal", False)),
                  load_balanced=bool(_cp_options.enable_load_balance), scale=named.get("scale"),
                  rotate=rotate_method_name(_cp_options.rotate_method), backend=backend)
    group = check_mesh(mesh)
    with torch.no_grad():
        if backward is None:
            return ring_sdpa(q, k, v, group, **kwargs)
        mode = _BackwardInstead(*(t.to_local().contiguous() for t in backward))
        with mode:
            ring_sdpa(q, k, v, group, **kwargs)
    return mode.grads


def _agreed(op: Any, named: dict[str, Any]) -> Any:
    """_check's mesh; its error is raised on every rank, before any
    collective (it travels in the handshake the other ranks' ring starts with)."""
    q = named["query"]
    if not (isinstance(q, DTensor) and q.device_mesh.ndim == 1):
        return _check(named, op)  # raises alike on every rank: placements only
    tensors = [t.to_local() if isinstance(t, DTensor) else t
               for t in (named["query"], named["key"], named["value"])]
    return agreed(op.__name__, check_mesh(q.device_mesh).group_name, tensors,
                  lambda: _check(named, op))


def _wrap(t: torch.Tensor, mesh: Any) -> DTensor:
    return DTensor.from_local(t, mesh, [Shard(2)], run_check=False)


def _forward_handler(op: Any, args: tuple, kwargs: dict) -> tuple:
    named = _bound(op, args, kwargs)
    mesh = _agreed(op, named)
    out, lse = _ring(named, mesh, _FORWARD[op])
    extras = []  # the kernel's other outputs (sequence offsets, RNG state): unused
    for ret in op._schema.returns[2:]:
        if isinstance(ret.type, torch.TensorType):
            extras.append(DTensor.from_local(out.new_empty(0), mesh, [Replicate()],
                                             run_check=False))
        else:  # max_q / max_k
            extras.append(out.shape[2])
    return (_wrap(out, mesh), _wrap(lse, mesh), *extras)


def _backward_handler(op: Any, args: tuple, kwargs: dict) -> tuple:
    named = _bound(op, args, kwargs)
    grad_out = named.get("grad_out", named.get("grad_out_"))
    mesh = _agreed(op, named)
    grads = _ring(named, mesh, _BACKWARD[op], (grad_out, named["out"], named["logsumexp"]))
    extra = (None,) * (len(op._schema.returns) - 3)  # efficient's attn_bias gradient
    return (*(_wrap(g, mesh) for g in grads), *extra)


def enable_dtensor_sdpa() -> None:
    """Routes the fused SDPA ops of sequence-sharded DTensors to the ring
    (DTensor's handler table, through cplib's patch registry)."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    for table, handler in ((_FORWARD, _forward_handler), (_BACKWARD, _backward_handler)):
        for op in table:
            registry.replace(OWNER, handlers, op, lambda _, h=handler: h)


def disable_dtensor_sdpa() -> None:
    """Puts DTensor's own handlers for those ops back."""
    registry.restore(OWNER)
