"""The ring's host work, pinned (issue 29, issue 44; docs/ring.md, "Host
work"): one fwd+bwd at S=64 on 2 gloo ranks (B=1 H=8 D=64 fp32, causal,
head-tail, p2p), where the kernels cost nothing and every ATen call and
collective is host time that leaves a GPU idle; called directly
(cplib.ring_sdpa) and as users call it (F.scaled_dot_product_attention inside
cplib.context_parallel), which must cost no more.

- ATen calls outside the attention kernels (torch.profiler's ``aten::``
  events, nested ones included, that are neither an attention kernel nor
  under one): at most MAX_ATEN_CALLS, the handshake's own calls included.
  Measured 37 on rank 0 (230 before the ring was made lean), 43 with
  CPLIB_CHECK_CONSISTENCY=0 (the local lengths then travel in a gather of
  their own).
- Collectives: the ring's K and V travel in one exchange per step, and dK and
  dV in one: three exchanges at N=2 (forward K|V, backward K|V, backward
  dK|dV; rotate="p2p" runs them as all-to-alls on gloo, as sends and
  receives on NCCL: tests/ring/test_ring_p2p.py). Every other collective is
  the handshake's, one per fwd+bwd (the backward through autograd is covered
  by the forward's), counted by ``cplib_c::handshake_debug_count``: 4 in
  all, torch's ring's count, each one call of the group's (no functional
  collective's Python wrapper). The group is resolved once (its rank and
  size reach the backward in the forward's record).
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F

import cplib

B, H, S, D = 1, 8, 64, 64
MAX_ATEN_CALLS = 45
KERNELS = ("aten::_scaled_dot_product_flash_attention_for_cpu",
           "aten::_scaled_dot_product_flash_attention_for_cpu_backward")
# Ring exchanges per fwd+bwd at N=2: K|V forward, K|V backward, dK|dV backward.
RING_EXCHANGES = 3
# The handshake's collectives per fwd+bwd: one, the forward's (the backward
# reached through autograd is covered by it).
MAX_HANDSHAKE_COLLECTIVES = 1
# With the handshake off, the forward gathers the local lengths instead (its
# backward takes them from the forward's record).
MAX_OTHER_COLLECTIVES = 1


def _under_kernel(e) -> bool:
    while e is not None:
        if e.name in KERNELS:
            return True
        e = e.cpu_parent
    return False


def _counts(checks: bool, via_sdpa: bool) -> dict:
    """Per rank: what one fwd+bwd calls, after a warm-up call."""
    rank, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)

    def shard(t):
        c = t.chunk(2 * n, dim=2)
        return torch.cat([c[rank], c[2 * n - 1 - rank]], dim=2).contiguous()

    q, k, v, grad_out = (shard(torch.randn(B, H, S, D, generator=g)) for _ in range(4))
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))

    def step():
        if via_sdpa:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out, _ = cplib.ring_sdpa(q, k, v, dist.group.WORLD, is_causal=True,
                                     load_balanced=True)
        return torch.autograd.grad(out, (q, k, v), grad_out)

    context = contextlib.nullcontext()
    if via_sdpa:  # head-tail shards, as made above
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (n,))
        context = cplib.context_parallel(mesh, load_balance=True)
    with cplib.consistency_checks(checks), context:
        step()
        dist.barrier()
        torch.ops.cplib_c.handshake_debug_count(True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            step()
        handshakes = torch.ops.cplib_c.handshake_debug_count(True)
    events = prof.events()
    names = Counter(e.name for e in events)
    return dict(
        aten=sum(1 for e in events if e.name.startswith("aten::") and not _under_kernel(e)),
        kernels=sum(names[k] for k in KERNELS),
        # The native layer's collectives (each one call into Python, csrc/torch/comm/).
        collectives=sum(c for name, c in names.items() if name.startswith("cplib_c::c10d_")),
        exchanges=names["cplib_c::c10d_send_recv"],
        sends=names["c10d::send"], receives=names["c10d::recv_"],
        all_to_alls=names["c10d::alltoall_base_"],
        group_lookups=names["cplib_c::group_info"],
        handshakes=handshakes,
    )


def _check(counts: list[dict]) -> None:
    for rank, c in enumerate(counts):
        assert c["kernels"] == 4, (rank, c)  # two steps, forward and backward
        assert c["aten"] <= MAX_ATEN_CALLS, (rank, c)
        # Every collective that is not the ring's is the handshake's (one
        # each) or, with the handshake off, the local lengths' gather.
        assert c["collectives"] - c["handshakes"] <= RING_EXCHANGES + MAX_OTHER_COLLECTIVES, \
            (rank, c)
        # p2p's exchanges: on gloo each one all-to-all of the group's, as
        # every other collective is (send/recv: NCCL, tests/ring/test_ring_p2p.py).
        assert c["exchanges"] == RING_EXCHANGES, (rank, c)
        assert c["all_to_alls"] == c["collectives"] and c["sends"] == c["receives"] == 0, \
            (rank, c)
        assert c["group_lookups"] == 1, (rank, c)


def _check_with_handshake(counts: list[dict]) -> None:
    _check(counts)
    for rank, c in enumerate(counts):
        assert c["handshakes"] == MAX_HANDSHAKE_COLLECTIVES, (rank, c)
        assert c["collectives"] == RING_EXCHANGES + c["handshakes"], (rank, c)


def test_host_work_with_the_handshake(ranks):
    _check_with_handshake(ranks(2).run(_counts, True, False))


def test_host_work_through_sdpa_in_context_parallel(ranks):
    # As users call it: no ATen call, collective or handshake more than the
    # direct call's.
    pool = ranks(2)
    direct, routed = pool.run(_counts, True, False), pool.run(_counts, True, True)
    _check_with_handshake(routed)
    for d, r in zip(direct, routed):
        assert r == d, (d, r)


def test_host_work_without_the_handshake(ranks):
    # CPLIB_CHECK_CONSISTENCY=0: no handshake; the local lengths travel in
    # one small all-gather per op instead.
    _check(ranks(2).run(_counts, False, False))
