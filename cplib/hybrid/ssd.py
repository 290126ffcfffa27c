"""Mamba2's SSD scan under context parallelism (Falcon-H1, Granite 4 hybrids,
Bamba, Zamba2, NemotronH, Mamba2), by state passing around the user's own
chunk-scan kernel (mamba_ssm's ``mamba_chunk_scan_combined`` on GPU,
transformers' torch version on CPU).

The recurrence ``h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t``, ``y_t = C_t h_t
(+ D x_t)`` carries a state entering a piece as ``exp(A cum_t) C_t h_in``
into position ``t`` (``cum_t`` the sum of the processed ``dt`` up to and
including ``t``), and out of the piece as ``exp(A cum_L) h_in``: the piece's
transition is one scalar decay per head. Each rank runs the kernel on its
pieces from a zero state (output and final state), the final states and
decays are exchanged (cplib/hybrid/state.py), and the carried term is added
in float32.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from .layout import SequenceLayout
from .state import incoming_states

__all__ = ["ssd_by_state"]


def _processed_dt(dt, dt_bias, dt_softplus: bool, dt_limit) -> torch.Tensor:
    """``dt`` as the kernel uses it: biased, softplus'd and clamped, float32."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    return torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])


def _scale(a: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    return a[..., None, None] * h


def ssd_by_state(kernel: Callable, layout: SequenceLayout, x, dt, A, B, C, chunk_size: int,
                 kw: dict[str, Any]):
    """The chunk scan over the whole sequence; returns (this rank's output,
    the exact state after its last position, or None unless
    ``return_final_states``)."""
    want_final = bool(kw.pop("return_final_states", False))
    gate = kw.pop("z", None)
    dt_args = (kw.get("dt_bias"), bool(kw.get("dt_softplus", False)),
               kw.get("dt_limit", (0.0, float("inf"))))
    sizes = [n for _, n in layout.pieces()]
    outs, finals, decays, cums = [], [], [], []
    for xs, dts, bs, cs in zip(*(t.split(sizes, dim=1) for t in (x, dt, B, C))):
        y0, h0 = kernel(xs, dts, A, bs, cs, chunk_size, z=None, initial_states=None,
                        return_final_states=True, **kw)
        cum = torch.cumsum(_processed_dt(dts, *dt_args) * A.float(), dim=1)  # (B, L, H)
        outs.append(y0)
        finals.append(h0.float())
        decays.append(cum[:, -1].exp())
        cums.append(cum)
    entering = incoming_states(layout, finals, decays, _scale)
    heads, groups = x.shape[2], B.shape[2]
    ys = []
    for y0, cum, cs, h_in in zip(outs, cums, C.split(sizes, dim=1), entering):
        c_heads = cs.float().repeat_interleave(heads // groups, dim=2)
        carried = torch.einsum("blhn,bhpn->blhp", c_heads, h_in) * cum.exp()[..., None]
        ys.append(y0 + carried.to(y0.dtype))
    y = torch.cat(ys, dim=1) if len(ys) > 1 else ys[0]
    if gate is not None:  # the kernel's z gate, after the carried term
        y = (y.float() * F.silu(gate.float())).to(y.dtype)
    final = _scale(decays[-1], entering[-1]) + finals[-1] if want_final else None
    return y, final
