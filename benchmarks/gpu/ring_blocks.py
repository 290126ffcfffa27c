"""T_blocks, for bench_ring_gpu.py.

T_blocks: the attention calls cplib's ring plans for a configuration (every
rank, every step: q rows x k rows, full or causal; from
``cplib_c::ring_plan_summary``, the planner the ring itself runs), each
timed alone, forward and backward through SDPA on one backend, in one
thread, with K/V heads expanded to q's as the ring's kernels see them. Their
sum over every rank is the attention work of the ring with nothing else: no
merge, no exchange, no host work between the calls. Against one full call it
says what the cut into blocks costs; against the ring's profiled attention
time, what the ring adds around the same kernels."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Call:
    rank: int
    step: int
    causal: bool
    q_len: int
    k_len: int


def plan_calls(s: int, n: int, causal: bool, rotate: str = "p2p") -> list[Call]:
    """Every attention call of the ring's plan on every rank (the layout the
    benchmark shards: head-tail when causal, sequential otherwise)."""
    from cplib.comm.native import ops
    layout = "head_tail" if causal else "sequential"
    flat = list(ops.ring_plan_summary(s, n, causal, layout, None, None, rotate))
    at = 1 + flat[0]
    calls = []
    for rank in range(n):
        steps, at = flat[at], at + 1
        for step in range(steps):
            count, at = flat[at + 5], at + 6
            for _ in range(count):
                kind, q_len, k_len = flat[at:at + 3]
                at += 3
                if kind not in (1, 2):
                    raise ValueError(f"a partial call ({q_len}x{k_len}) in a dense plan")
                calls.append(Call(rank, step, kind == 2, q_len, k_len))
    return calls


def _kernel(backend: str):
    from torch.nn.attention import SDPBackend
    return {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]


def time_blocks(calls: list[Call], n: int, b: int, h: int, d: int, dtype: torch.dtype,
                device: torch.device, backend: str, timeit, sync) -> dict:
    """T_blocks on one backend: each distinct call shape timed once (fwd+bwd,
    median of ``timeit``), summed over the plan; per rank, in total, and the
    distinct shapes with their times (seconds)."""
    times: dict[tuple[bool, int, int], float] = {}
    g = torch.Generator(device=device).manual_seed(0)
    for c in calls:
        key = (c.causal, c.q_len, c.k_len)
        if key in times:
            continue
        q = torch.randn(b, h, c.q_len, d, generator=g, device=device, dtype=dtype)
        k, v = (torch.randn(b, h, c.k_len, d, generator=g, device=device, dtype=dtype)
                for _ in range(2))
        dout = torch.randn_like(q)
        for t in (q, k, v):
            t.requires_grad_(True)

        def step(q=q, k=k, v=v, dout=dout, causal=c.causal):
            q.grad = k.grad = v.grad = None
            F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(dout)
        if device.type == "cuda":
            from torch.nn.attention import sdpa_kernel
            with sdpa_kernel([_kernel(backend)]):
                times[key] = timeit(step, sync=sync)
        else:
            times[key] = timeit(step, sync=sync)
    per_rank = [0.0] * n
    for c in calls:
        per_rank[c.rank] += times[(c.causal, c.q_len, c.k_len)]
    return dict(total_s=sum(per_rank), per_rank_s=per_rank, calls=len(calls),
                shapes=[dict(causal=k[0], q=k[1], k=k[2], seconds=t) for k, t in times.items()])

