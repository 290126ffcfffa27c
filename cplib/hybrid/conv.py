"""Short causal convolutions under context parallelism (the kernel-4 conv of
Gated DeltaNet and Mamba2 layers, LFM2's and Inkling's short convs): the
user's conv function runs on this rank's pieces, each preceded by the
``k - 1`` positions before it, fetched by ``seq_halo`` (tp_conv's neighbour
exchange on the sequence dim, csrc/torch/conv/seq_halo.cpp) in the
context's layout; the outputs at the halo positions are dropped."""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..conv.seq_halo import seq_halo
from .layout import SequenceLayout

__all__ = ["causal_conv_by_halo"]


def causal_conv_by_halo(conv: Callable[..., torch.Tensor], layout: SequenceLayout,
                        x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        kw: dict[str, Any]) -> torch.Tensor:
    """``conv(x, weight, bias, **kw)`` over the whole sequence, for this rank's
    (B, C, L_local) shard ``x``; ``weight`` is (C, k)."""
    halo = weight.shape[-1] - 1
    layout.check_pieces(f"a causal convolution of kernel {halo + 1}", max(halo, 1))
    first = layout.first_len()
    extended = seq_halo(x, halo, layout.group_name, dim=-1, first_len=first)
    out = conv(extended, weight, bias, **kw)
    if first is None:
        return out[..., halo:]
    return torch.cat([out[..., halo:halo + first], out[..., 2 * halo + first:]], dim=-1)
