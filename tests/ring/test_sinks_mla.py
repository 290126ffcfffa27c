"""Attention sinks and MLA head dims (v's head dim differing from q/k's) in
ring_sdpa, ulysses_sdpa and usp_sdpa against an fp64 reference on the full
sequence: out, lse and the gradients of q, k, v and the sinks, every
rotation, with and without load balancing, documents and windows; opcheck
and fullgraph compile (ring and Ulysses) with sinks; bad sinks raising ValueError."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import cplib
from cplib.comm.native import ops
from cplib.ulysses.usp_layout import usp_groups
from harness import assert_close
from ring_cases import global_tensor
from ring_mask_cases import local, visible

TOL = dict(atol=1e-10, rtol=1e-10)


def sink_reference(q, k, v, cot, see: torch.Tensor, sinks, scale=None):
    """fp64 (out, lse, dq, dk, dv, dsinks): softmax over the visible keys and
    one sink logit per head that has no value."""
    q, k, v = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    s = None if sinks is None else sinks.detach().double().requires_grad_(True)
    groups = q.shape[1] // k.shape[1]
    kx, vx = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ kx.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    scores = scores.masked_fill(~see, float("-inf"))
    if s is not None:
        scores = torch.cat([scores, s.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], -1)
    lse = torch.logsumexp(scores, -1)
    probs = torch.softmax(scores, -1)
    out = (probs[..., :vx.shape[2]]) @ vx
    out.backward(cot.double())
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad, None if s is None else s.grad


def _inputs(b, hq, hkv, s, dqk, dv, seed, sinks=True):
    q = global_tensor((b, hq, s, dqk), torch.float64, seed)
    k = global_tensor((b, hkv, s, dqk), torch.float64, seed + 1)
    v = global_tensor((b, hkv, s, dv), torch.float64, seed + 2)
    cot = global_tensor((b, hq, s, dv), torch.float64, seed + 3)
    snk = global_tensor((hq,), torch.float64, seed + 4) if sinks else None
    return q, k, v, cot, snk


def _reduced(g: torch.Tensor) -> torch.Tensor:
    g = g.clone()
    dist.all_reduce(g)
    return g


# ---------------------------------------------------------------- ring


def _ring_case(rotate, lb, causal, dqk, dv, sinks, docs, window, seed) -> None:
    b, hq, hkv, s = 2, 4, 2, 16 * dist.get_world_size()
    q, k, v, cot, snk = _inputs(b, hq, hkv, s, dqk, dv, seed, sinks)
    cu = [0, 5, 6, s // 2 + 3, s] if docs else None
    see = visible(s, causal=causal, cu_seqlens=cu, window=window)
    ref = sink_reference(q, k, v, cot, see, snk)
    ql, kl, vl = (local(t, s, lb).requires_grad_(True) for t in (q, k, v))
    sl = None if snk is None else snk.clone().requires_grad_(True)
    extra = {}
    if docs:
        extra["cu_seqlens"] = torch.tensor(cu)
    if window is not None:
        extra["window"] = window
    out, lse = cplib.ring_sdpa(ql, kl, vl, dist.group.WORLD, is_causal=causal, load_balanced=lb,
                               rotate=rotate, sinks=sl, **extra)
    out.backward(local(cot, s, lb))
    what = (f"ring {rotate} lb={lb} causal={causal} dqk={dqk} dv={dv} sinks={sinks} "
            f"docs={docs} window={window}")
    for label, got, want in (("out", out, ref[0]), ("lse", lse, ref[1]), ("dq", ql.grad, ref[2]),
                             ("dk", kl.grad, ref[3]), ("dv", vl.grad, ref[4])):
        assert_close(got, local(want, s, lb), what=f"{label} [{what}]", **TOL)
    if sinks:
        assert_close(_reduced(sl.grad), ref[5], what=f"dsinks [{what}]", **TOL)


def _check_ring() -> int:
    count = 0
    for rotate in ("p2p", "alltoall", "allgather"):
        for lb in (True, False):
            # sinks alone, MLA both ways, with documents, with windows
            _ring_case(rotate, lb, True, 8, 8, True, False, None, 0)
            _ring_case(rotate, lb, True, 12, 8, True, True, None, 10)
            _ring_case(rotate, lb, False, 8, 12, False, False, (5, 3), 20)
            _ring_case(rotate, lb, True, 12, 8, True, False, (6, 0), 30)
            count += 4
    return count


# ---------------------------------------------------------------- Ulysses and USP


def _usp_case(u, lb, causal, dqk, dv, sinks, rotate, seed) -> None:
    n = dist.get_world_size()
    mesh = DeviceMesh("cpu", list(range(n)))
    groups = usp_groups(mesh.get_group(), u)
    b, hq, hkv, s = 2, 4, 2, 8 * n
    q, k, v, cot, snk = _inputs(b, hq, hkv, s, dqk, dv, seed, sinks)
    ref = sink_reference(q, k, v, cot, visible(s, causal=causal), snk)
    balancer = cplib.usp_load_balancer(s, n, u) if lb else None
    ql, kl, vl, cl = cplib.shard(mesh, [q, k, v, cot], [2] * 4, balancer)
    ql, kl, vl = (t.clone().requires_grad_(True) for t in (ql, kl, vl))
    sl = None if snk is None else snk.clone().requires_grad_(True)
    if groups.ring_group is None:
        out, lse = cplib.ulysses_sdpa(ql, kl, vl, groups.ulysses_group, is_causal=causal,
                                      sinks=sl)
    else:
        out, lse = cplib.usp_sdpa(ql, kl, vl, groups.ulysses_group, groups.ring_group,
                                  is_causal=causal, load_balanced=lb, rotate=rotate, sinks=sl)
    out.backward(cl)
    want = cplib.shard(mesh, list(ref[:5]), [2] * 5, balancer)
    what = f"usp u={u} lb={lb} causal={causal} dqk={dqk} dv={dv} sinks={sinks} {rotate}"
    for label, got, w in zip(("out", "lse", "dq", "dk", "dv"),
                             (out, lse, ql.grad, kl.grad, vl.grad), want):
        assert_close(got, w, what=f"{label} [{what}]", **TOL)
    if sinks:
        assert_close(_reduced(sl.grad), ref[5], what=f"dsinks [{what}]", **TOL)


def _check_ulysses() -> int:
    n = dist.get_world_size()
    count = 0
    for u in sorted({2, n}):
        for rotate in ("p2p", "allgather") if u < n else ("p2p",):
            for lb in (True, False) if u < n else (False,):
                _usp_case(u, lb, True, 8, 8, True, rotate, 40)
                _usp_case(u, lb, True, 12, 8, True, rotate, 50)
                _usp_case(u, lb, False, 8, 12, False, rotate, 60)
                count += 3
    return count


# ---------------------------------------------------------------- ops: opcheck, compile, errors


def _check_ops() -> int:
    n = dist.get_world_size()
    name = dist.group.WORLD.group_name
    q, k, v, _, snk = _inputs(2, 4, 2, 6 * n, 12, 8, 70)
    ql, kl, vl = (local(t, 6 * n, True).requires_grad_(True) for t in (q, k, v))
    sl = snk.clone().requires_grad_(True)
    torch.library.opcheck(ops.ring_sdpa.default, (ql, kl, vl, name, True, "head_tail"),
                          {"sinks": sl})
    # Ulysses' local attention with sinks and MLA (a world of one: no group)
    torch.library.opcheck(ops.ulysses_local_sdpa.default,
                          (q.clone().requires_grad_(True), k.clone().requires_grad_(True),
                           v.clone().requires_grad_(True), True, None, "auto", sl))

    def attend(a, b_, c, s_):
        out, lse = cplib.ring_sdpa(a, b_, c, name, is_causal=True, load_balanced=True, sinks=s_)
        return out * 2.0, lse

    def attend_ulysses(a, b_, c, s_):
        out, lse = cplib.ulysses_sdpa(a, b_, c, name, is_causal=True, sinks=s_)
        return out * 2.0, lse

    for fn_eager, seq in ((attend, (ql, kl, vl)),
                          (attend_ulysses, [t.chunk(n, 2)[dist.get_rank()] for t in (q, k, v)])):
        torch._dynamo.reset()
        compiled = torch.compile(fn_eager, backend="aot_eager", fullgraph=True)
        grads = []
        for fn in (fn_eager, compiled):
            ins = [t.detach().clone().requires_grad_(True) for t in (*seq, sl)]
            out, lse = fn(*ins)
            out.square().sum().backward()
            grads.append([out, lse] + [t.grad for t in ins])
        for label, a, b_ in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), *grads):
            assert_close(b_, a, what=f"compiled {fn_eager.__name__} {label}", **TOL)

    for bad, msg in ((torch.zeros(3, dtype=torch.float64), "sinks must have shape \\(4,\\)"),
                     (torch.zeros(4, dtype=torch.int64), "sinks must have q's dtype")):
        with pytest.raises(ValueError, match=msg):
            cplib.ring_sdpa(ql, kl, vl, name, sinks=bad)
        with pytest.raises(ValueError, match=msg):
            ops.ring_sdpa(ql, kl, vl, name, sinks=bad)
    return 4


@pytest.mark.parametrize("world_size", [2, 4])
def test_sinks_mla_ring_and_usp(ranks, world_size):
    pool = ranks(world_size)
    assert pool.run(_check_ring) == [24] * world_size
    # world 2: pure Ulysses; world 4: USP 2 x 2 (2 rotations x 2 balancings) and Ulysses
    assert pool.run(_check_ulysses) == [3 if world_size == 2 else 15] * world_size
    if world_size == 2:
        assert pool.run(_check_ops) == [4] * world_size
