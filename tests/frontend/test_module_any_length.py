"""The ``_ContextParallel`` module path takes every layout the region takes:
inputs cut by ``_context_parallel_shard`` at any length (head-tail shards of
``AnyLengthHeadTailLoadBalancer``, sequential shards of an odd length),
causal and not, give one process's output and gradients (2 and 4 gloo ranks,
float64). The ring learns every rank's length in its handshake and derives
the global length from it. Before: "load_balanced needs even local lengths"
(equal odd shards) or "ranks disagree on q.size(2)" (shards that differ)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from harness import assert_close

TOL = dict(atol=1e-10, rtol=1e-10)


class _Attention(nn.Module):
    def __init__(self, is_causal: bool):
        super().__init__()
        self.is_causal = is_causal

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.is_causal)


def _module_path(s: int, head_tail: bool, is_causal: bool) -> int:
    import cplib
    from cplib import AnyLengthHeadTailLoadBalancer, _context_parallel_shard, _ContextParallel

    n = dist.get_world_size()
    mesh = DeviceMesh("cpu", list(range(n)))
    g = torch.Generator().manual_seed(s)
    q, k, v, go = (torch.randn(1, 2, s, 8, generator=g, dtype=torch.float64) for _ in range(4))
    want = [q, k, v]
    for t in want:
        t.requires_grad_(True)
    out = F.scaled_dot_product_attention(*want, is_causal=is_causal)
    out.backward(go)
    lb = AnyLengthHeadTailLoadBalancer(s, n, "cpu") if head_tail else None
    local = _context_parallel_shard(mesh, [q.detach(), k.detach(), v.detach(), go], [2] * 4, lb)
    for t in local[:3]:
        t.requires_grad_(True)
    attn = parallelize_module(_Attention(is_causal), mesh, _ContextParallel(
        seq_dim=2, attention_type=_ContextParallel.AttentionType.SDPA))
    cplib._enable_context_parallel_dispatcher()
    try:
        got = attn(*local[:3])
        got.backward(local[3])
    finally:
        cplib._disable_context_parallel_dispatcher()
    what = f"S={s} N={n} head_tail={head_tail} causal={is_causal}"
    full = cplib.context_parallel_unshard(mesh, [got.detach()] + [t.grad for t in local[:3]],
                                          [2] * 4, lb)
    for name, a, b in zip(("out", "dq", "dk", "dv"), full, [out] + [t.grad for t in want]):
        assert_close(a, b.detach(), what=f"{what}: {name}", **TOL)
    return 1


def _cases(cases: list[tuple[int, bool, bool]]) -> int:
    return sum(_module_path(*case) for case in cases)


# (S, head-tail, causal): shards that differ (17 over 2: 9 and 8), equal odd
# shards (18 over 2: 9 and 9), sequential, non-causal; 19 over 4 ranks.
CASES = {2: [(17, True, True), (18, True, True), (17, False, True), (17, True, False)],
         4: [(19, True, True)]}


@pytest.mark.parametrize("world_size", [2, 4])
def test_module_path_takes_any_length(ranks, world_size):
    cases = CASES[world_size]
    assert ranks(world_size).run(_cases, cases) == [len(cases)] * world_size
