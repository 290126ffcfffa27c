"""USP (ring_degree x ulysses_degree) at world size 4 against the full
computation in one process: usp_sdpa on the USP layout (load balanced and
not), context_parallel(..., ulysses_degree=U) with the HF Llama test model
(loss and every parameter gradient), the handle's unshard, _ContextParallel
with ulysses_degree, compile, and bad degrees/heads raising on every rank."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

import cplib
from cplib.comm.native import ops
from cplib.ulysses.usp_layout import usp_groups
from cp_runs import dispatched
from harness import assert_close
from model_cases import _compare_grads, _llama, _lm_loss, _setup
from ring_cases import global_tensor, reference

TOL = dict(atol=2e-5, rtol=2e-4)


def _mesh() -> DeviceMesh:
    return DeviceMesh("cpu", list(range(dist.get_world_size())))


def _usp_case(mesh, u, dtype, causal, lb, hq, hkv, d, b, s, rotate, seed) -> None:
    n = mesh.size()
    groups = usp_groups(mesh.get_group(), u)
    balancer = cplib.usp_load_balancer(s, n, u) if lb else None
    q, k, v, cot = (global_tensor((b, h, s, d), dtype, seed + i)
                    for i, h in enumerate((hq, hkv, hkv, hq)))
    ref = reference(q, k, v, cot, is_causal=causal, scale=None)
    ql, kl, vl, cl = cplib.shard(mesh, [q, k, v, cot], [2, 2, 2, 2], balancer)
    ql, kl, vl = (t.clone().requires_grad_(True) for t in (ql, kl, vl))
    if groups.ring_group is None:  # U = N: pure Ulysses
        out, lse = cplib.ulysses_sdpa(ql, kl, vl, groups.ulysses_group, is_causal=causal)
    elif groups.ulysses_group is None:  # U = 1: the ring
        out, lse = cplib.ring_sdpa(ql, kl, vl, groups.ring_group, is_causal=causal,
                                   load_balanced=lb, rotate=rotate)
    else:
        out, lse = cplib.usp_sdpa(ql, kl, vl, groups.ulysses_group, groups.ring_group,
                                  is_causal=causal, load_balanced=lb, rotate=rotate)
    out.backward(cl)
    what = f"usp u={u} {dtype} causal={causal} lb={lb} hq={hq} hkv={hkv} d={d} {rotate}"
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    want = cplib.shard(mesh, [ref[0], ref[1], ref[2], ref[3], ref[4]], [2] * 5, balancer)
    for label, got, w in zip(("out", "lse", "dq", "dk", "dv"),
                             (out, lse, ql.grad, kl.grad, vl.grad), want):
        assert_close(got.double(), w, atol=tol, rtol=tol, what=f"{label} [{what}]")


def _check_usp_sdpa() -> int:
    mesh = _mesh()
    cases = [  # (u, dtype, causal, lb, hq, hkv, d, b, s, rotate)
        (2, torch.float64, True, True, 4, 2, 8, 2, 16, "p2p"),
        (2, torch.float64, True, False, 4, 1, 5, 1, 12, "alltoall"),
        (2, torch.float64, False, True, 4, 4, 16, 1, 8, "allgather"),
        (2, torch.float32, True, True, 2, 2, 33, 2, 24, "p2p"),
        (4, torch.float64, True, True, 4, 2, 8, 1, 16, "p2p"),  # ring of one
        (1, torch.float64, True, True, 4, 2, 8, 1, 16, "p2p"),  # Ulysses of one
    ]
    for seed, case in enumerate(cases):
        _usp_case(mesh, *case, seed=seed)
    return len(cases)


def test_usp_sdpa_matches_full_sequence_reference(ranks):
    assert ranks(4).run(_check_usp_sdpa) == [6] * 4


# ---------------------------------------------------- context_parallel + HF Llama


def _check_llama_usp(u: int, load_balance: bool) -> int:
    mesh, rank, n = _setup("native")
    b, s = 2, 32 * n
    ref = _llama(0)
    cp_model = copy.deepcopy(ref)
    ids = torch.randint(0, 96, (b, s), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(s).expand(b, s)
    labels = torch.cat([ids[:, 1:], torch.full((b, 1), -100)], dim=1)
    ref_loss = _lm_loss(ref, ids, pos, labels)
    ref_loss.backward()
    with context_parallel_usp(mesh, [ids, pos, labels], load_balance, u) as cp:
        assert ids.shape == (b, s // n)
        (full_pos,) = cp.unshard([pos], [1])  # the handle knows the layout
        assert torch.equal(full_pos, torch.arange(s).expand(b, s))
        ops.ring_debug_bytes_sent(True)
        ops.ulysses_debug_bytes_sent(True)
        loss = _lm_loss(cp_model, ids, pos, labels)
        loss.backward()
        # every attention went through Ulysses, and through the ring unless U = N
        assert ops.ulysses_debug_bytes_sent(True) > 0
        assert (ops.ring_debug_bytes_sent(True) > 0) == (u < n)
    total = loss.detach().clone()
    dist.all_reduce(total)
    what = f"llama ulysses_degree={u} lb={load_balance}"
    assert_close(total, ref_loss.detach(), what=f"{what}: loss", **TOL)
    return _compare_grads(cp_model, ref, what)


def context_parallel_usp(mesh, buffers, load_balance, u):
    return cplib.context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1] * len(buffers),
                                  load_balance=load_balance, ulysses_degree=u)


def test_context_parallel_ulysses_degree_hf_llama(ranks):
    pool = ranks(4)
    for u, lb in ((2, True), (2, False), (4, True)):
        counts = pool.run(_check_llama_usp, u, lb)
        assert counts[0] > 10 and all(c == counts[0] for c in counts)


# ---------------------------------------------------- SDPA in the context, unshard, compile


def _attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _check_context_sdpa(backend: str | None) -> int:
    mesh, n = _mesh(), dist.get_world_size()
    b, hq, hkv, s, d = 2, 4, 2, 8 * n, 8
    q, k, v, cot = (global_tensor((b, h, s, d), torch.float64, 50 + i)
                    for i, h in enumerate((hq, hkv, hkv, hq)))
    ref = reference(q, k, v, cot, is_causal=True, scale=None)
    count = 0
    for u in (2, 4):
        fn = _attention if backend is None else torch.compile(_attention, backend=backend,
                                                              fullgraph=True)
        torch._dynamo.reset()
        bufs = [t.clone() for t in (q, k, v, cot)]
        with cplib.context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2] * 4,
                                    load_balance=True, ulysses_degree=u) as cp:
            ql, kl, vl, cl = bufs
            for t in (ql, kl, vl):
                t.requires_grad_(True)
            out = fn(ql, kl, vl)
            out.backward(cl)
            got = cp.unshard([out.detach(), ql.grad, kl.grad, vl.grad], [2] * 4)
            # the non-differentiable unshard follows the active layout too
            (out_again,) = cplib.context_parallel_unshard(mesh, [out.detach()], [2])
            for t in (ql, kl, vl):
                t.requires_grad_(False)
        what = f"context sdpa ulysses_degree={u} compile={backend}"
        assert torch.equal(out_again, got[0]), what
        for label, g, w in zip(("out", "dq", "dk", "dv"), got, (ref[0],) + ref[2:]):
            assert_close(g, w, atol=1e-10, rtol=1e-10, what=f"{label} [{what}]")
        count += 1
    return count


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_context_parallel_ulysses_sdpa_and_unshard(ranks, backend):
    assert ranks(4).run(_check_context_sdpa, backend) == [2] * 4


class _Attn(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _check_module_style() -> None:
    mesh, n = _mesh(), dist.get_world_size()
    b, h, s, d = 1, 4, 8 * n, 8
    q, k, v = (global_tensor((b, h, s, d), torch.float64, 60 + i) for i in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    attn = parallelize_module(_Attn(), mesh, cplib._ContextParallel(
        seq_dim=2, attention_type=cplib._ContextParallel.AttentionType.SDPA, ulysses_degree=2))
    balancer = cplib.usp_load_balancer(s, n, 2)
    ql, kl, vl = cplib._context_parallel_shard(mesh, [q, k, v], [2, 2, 2], balancer)
    out = dispatched(attn, ql, kl, vl)
    (full,) = cplib.context_parallel_unshard(mesh, [out], [2], balancer)
    assert_close(full, want, atol=1e-10, rtol=1e-10, what="_ContextParallel ulysses_degree=2")


def test_context_parallel_style_ulysses_degree(ranks):
    ranks(4).run(_check_module_style)


# ---------------------------------------------------- bad degrees and heads


def _check_bad_usp() -> list[str]:
    mesh, n = _mesh(), dist.get_world_size()
    messages = []
    x = torch.randn(1, 6, 8 * n, 8)
    for u in (3, 0):
        with pytest.raises(ValueError) as info:
            with cplib.context_parallel(mesh, buffers=[x.clone()], buffer_seq_dims=[2],
                                        ulysses_degree=u):
                pass
        messages.append(str(info.value))
    bufs = [x.clone() for _ in range(3)]
    with pytest.raises(ValueError) as info:  # 6 heads over U = 4
        with cplib.context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2] * 3,
                                    ulysses_degree=4):
            _attention(*bufs)
    messages.append(str(info.value))
    # nothing hangs: the groups still work
    bufs = [torch.randn(1, 4, 8 * n, 8) for _ in range(3)]
    with cplib.context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2] * 3, ulysses_degree=2):
        assert _attention(*bufs).shape == (1, 4, 8, 8)
    return messages


def test_usp_bad_degree_and_heads_raise_on_every_rank(ranks):
    per_rank = ranks(4).run(_check_bad_usp)
    assert all(m == per_rank[0] for m in per_rank)
    first = per_rank[0]
    assert "ulysses_degree=3 does not divide the context-parallel world size 4" in first[0]
    assert "ulysses_degree must be a positive int, got 0" in first[1]
    assert "6 query heads cannot be split over the Ulysses degree 4" in first[2]
