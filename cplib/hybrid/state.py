"""State passing (LASP-style) for linear recurrences under context parallelism.

A linear recurrence ``h_t = A_t h_{t-1} + b_t`` maps the state entering a
chunk of the sequence to the state leaving it affinely:
``h_out = M h_in + Z``, where ``Z`` is the chunk's final state from a zero
start and ``M`` its state transition (a ``d_k x d_k`` matrix per head for the
delta rule, a scalar decay per head for Mamba2's SSD). Each rank computes
``(Z, M)`` of its own pieces, one all-gather shares them (bytes independent
of the sequence length), and every rank composes the incoming states of its
pieces in global order: ``h_in[0] = 0``, ``h_in[c + 1] = M_c h_in[c] + Z_c``.

The all-gather is ``flex_cp_allgather`` (one collective for ``Z`` and ``M``
together; its backward is a reduce-scatter, so the gradients of the
incoming states flow back to the ranks whose pieces produced them).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..flex.allgather import flex_cp_allgather
from .layout import SequenceLayout

__all__ = ["incoming_states", "exchanged_bytes"]

Apply = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def incoming_states(layout: SequenceLayout, finals: list[torch.Tensor],
                    transitions: list[torch.Tensor], apply: Apply) -> list[torch.Tensor]:
    """The state entering each of this rank's pieces.

    ``finals[i]`` (B, H, *state) and ``transitions[i]`` (B, H, *transition)
    belong to local piece ``i``; ``apply(M, h)`` is ``M h`` for one piece's
    transition. Differentiable in every rank's finals and transitions."""
    b, h = finals[0].shape[:2]
    state_shape, trans_shape = finals[0].shape[2:], transitions[0].shape[2:]
    # (B, H, pieces, flat): the pieces along the gathered dim.
    z = torch.stack([f.reshape(b, h, -1) for f in finals], dim=2)
    m = torch.stack([t.reshape(b, h, -1) for t in transitions], dim=2)
    z_all, m_all = flex_cp_allgather(z, m, 2, layout.group_name)
    per_rank = layout.pieces_per_rank
    mine = {(layout.rank, i) for i in range(len(finals))}
    entering: dict[tuple[int, int], torch.Tensor] = {}
    # A rank whose pieces come first reads nothing it gathered; an exact zero
    # (empty slices) still links the gather to its outputs, so that every rank
    # runs the gather's backward (a collective) and none waits alone.
    state = torch.zeros_like(finals[0]) + (z_all[:, :, :0].sum() + m_all[:, :, :0].sum())
    for owner in layout.chunk_order():
        if owner in mine:
            entering[owner] = state
        if len(entering) == len(mine):
            break  # later chunks do not feed this rank's pieces
        index = owner[0] * per_rank + owner[1]
        zc = z_all[:, :, index].reshape(b, h, *state_shape)
        mc = m_all[:, :, index].reshape(b, h, *trans_shape)
        state = apply(mc, state) + zc
    return [entering[(layout.rank, i)] for i in range(len(finals))]


def exchanged_bytes(layout: SequenceLayout, state_numel: int, transition_numel: int,
                    itemsize: int = 4) -> dict[str, int]:
    """Bytes of one state exchange per rank (forward): what a rank sends
    (its pieces' states and transitions) and receives (everyone else's).
    ``*_numel`` are per piece, over batch and heads. Independent of the
    sequence length."""
    sent = layout.pieces_per_rank * (state_numel + transition_numel) * itemsize
    return {"sent": sent, "received": (layout.world_size - 1) * sent}
