"""``cplib_c::seq_halo``: the causal halo of a sequence-sharded tensor
(csrc/torch/conv/seq_halo.cpp), with its fake kernels and autograd.

A causal convolution of kernel ``k`` over a sequence sharded across ranks
needs, for each local piece, the ``k - 1`` positions just before it, held by
the rank with the previous chunk. ``seq_halo`` fetches them with
``tp_conv``'s neighbour exchange (one all-to-all towards the two neighbours)
and returns this rank's pieces, each preceded by its halo:

* sequential shards (``first_len=None``): ``[h | x]``;
* head-tail shards (rank r holds chunks r and 2N-1-r; ``first_len`` is the
  first chunk's length): ``[h1 | x[:first_len] | h2 | x[first_len:]]``.

Halos before the start of the sequence are zero, as a causal conv's own
padding. The backward adds each halo's gradient to the positions it came
from, on the rank that holds them.
"""

from __future__ import annotations

import torch

from ..attention.args import check_inputs
from ..comm.handshake import agreed
from ..comm.native import GroupLike, group_name_of, normalize_dim, ops, reject_real_in_fake

__all__ = ["seq_halo"]


def _extended_shape(x, dim: int, halo: int, first_len: int, extended: bool) -> list[int]:
    d = normalize_dim(dim, x.dim(), "dim")
    pad = (2 if first_len >= 0 else 1) * halo
    shape = list(x.shape)
    shape[d] += -pad if extended else pad
    return shape


@torch.library.register_fake("cplib_c::seq_halo")
def _seq_halo_fake(x, dim, halo, first_len, group_name):
    reject_real_in_fake("seq_halo", x)
    return x.new_empty(_extended_shape(x, dim, halo, first_len, False))


@torch.library.register_fake("cplib_c::seq_halo_backward")
def _seq_halo_backward_fake(grad_ext, dim, halo, first_len, group_name):
    reject_real_in_fake("seq_halo_backward", grad_ext)
    return grad_ext.new_empty(_extended_shape(grad_ext, dim, halo, first_len, True))


torch.library.register_fake("cplib_c::seq_halo_backward_covered", _seq_halo_backward_fake)


def _setup(ctx, inputs, output):
    _, ctx.dim, ctx.halo, ctx.first_len, ctx.group_name = inputs


def _backward(ctx, grad_ext):
    # Covered by the forward's handshake: none of its own (one per fwd+bwd).
    grad = ops.seq_halo_backward_covered(grad_ext.contiguous(), ctx.dim, ctx.halo,
                                         ctx.first_len, ctx.group_name)
    return grad, None, None, None, None


torch.library.register_autograd("cplib_c::seq_halo", _backward, setup_context=_setup)


def seq_halo(x: torch.Tensor, halo: int, group: GroupLike, *, dim: int = -1,
             first_len: int | None = None) -> torch.Tensor:
    """This rank's pieces of a sequence-sharded ``x`` (along ``dim``), each
    preceded by the ``halo`` positions before it (see the module docstring);
    differentiable. ``first_len`` (head-tail shards) is the length of the
    first of this rank's two chunks; None for sequential shards. Every piece
    must hold at least ``halo`` positions (ValueError on every rank)."""
    name = group_name_of(group)

    def check() -> int:
        check_inputs("seq_halo", x=x)
        for what, value in (("halo", halo), ("dim", dim), ("first_len", first_len)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"cplib.seq_halo: {what} must be an int, got {value!r}")
        if halo < 0:
            raise ValueError(f"cplib.seq_halo: halo={halo} must be >= 0")
        if first_len is not None and first_len < 0:
            raise ValueError(f"cplib.seq_halo: first_len={first_len} must be >= 0 (or None)")
        return -1 if first_len is None else first_len

    first = agreed("seq_halo", name, (x,), check)
    return ops.seq_halo(x, dim, halo, first, name)
