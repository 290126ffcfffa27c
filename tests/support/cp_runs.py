"""Two steps many front-end tests repeat: a fwd+bwd on the sharded buffers
of a ``context_parallel`` block, and a call made with torch's SDPA
dispatcher switched to cplib's (as ``_ContextParallel`` modules need)."""

from __future__ import annotations

from typing import Any, Callable

import torch

import cplib


def sharded_fwd_bwd(cp: Any, bufs: list[torch.Tensor],
                    attention: Callable[..., torch.Tensor]) -> list[torch.Tensor]:
    """out, dq, dk, dv of ``attention(q, k, v)`` on the sharded (q, k, v,
    cotangent) in ``bufs``, unsharded by the context ``cp``; the buffers stop
    requiring grad afterwards (the context restores them on exit)."""
    ql, kl, vl, cl = bufs
    for t in (ql, kl, vl):
        t.requires_grad_(True)
    try:
        out = attention(ql, kl, vl)
        out.backward(cl)
        return cp.unshard([out.detach(), ql.grad, kl.grad, vl.grad], [2] * 4)
    finally:
        for t in (ql, kl, vl):
            t.requires_grad_(False)


def dispatched(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with cplib's SDPA dispatcher on, switched off on every exit."""
    cplib._enable_context_parallel_dispatcher()
    try:
        return fn(*args)
    finally:
        cplib._disable_context_parallel_dispatcher()
