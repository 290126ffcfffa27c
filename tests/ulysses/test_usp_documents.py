"""USP (ulysses_degree 2) with packed documents, sliding windows and any
length, at world sizes 2 (pure Ulysses) and 4 (2 ring positions x 2 Ulysses
ranks), load balanced and not: usp_sdpa / ulysses_sdpa, context_parallel (one
case compiled, fullgraph) and _ContextParallel against the fp64
single-process masked reference (out and the gradients of q, k, v)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

import cplib
from cplib.ulysses.usp_layout import usp_groups
from cp_runs import sharded_fwd_bwd
from harness import assert_close
from ring_cases import global_tensor
from ring_mask_cases import masked_reference, visible

TOL = dict(atol=1e-10, rtol=1e-10)
U = 2


def _mesh() -> DeviceMesh:
    return DeviceMesh("cpu", list(range(dist.get_world_size())))


def _inputs(s: int, seed: int):
    return tuple(global_tensor((1, h, s, 8), torch.float64, seed + i)
                 for i, h in enumerate((4, 2, 2, 4)))  # q, k, v (GQA), cotangent


def _op_case(mesh, s, causal, lb, docs, window, per_document, rotate, seed) -> None:
    n = mesh.size()
    groups = usp_groups(mesh.get_group(), U)
    q, k, v, cot = _inputs(s, seed)
    ref = masked_reference(q, k, v, cot, visible(s, causal=causal, cu_seqlens=docs,
                                                  window=window))
    balancer = cplib.usp_load_balancer(s, n, U, head_tail=lb,
                                       cu_seqlens=docs if per_document else None)
    ql, kl, vl, cl = cplib.shard(mesh, [q, k, v, cot], [2] * 4, balancer)
    ql, kl, vl = (t.requires_grad_(True) for t in (ql, kl, vl))
    cu = None if docs is None else torch.tensor(docs, dtype=torch.int32)
    if groups.ring_group is None:  # U = N: pure Ulysses, whose layout is sequential
        out, lse = cplib.ulysses_sdpa(ql, kl, vl, groups.ulysses_group, is_causal=causal,
                                      cu_seqlens=cu, window=window, seq_len=s)
    else:
        out, lse = cplib.usp_sdpa(ql, kl, vl, groups.ulysses_group, groups.ring_group,
                                  is_causal=causal, load_balanced=lb, rotate=rotate,
                                  cu_seqlens=cu, window=window, seq_len=s,
                                  per_document=per_document)
    out.backward(cl)
    what = (f"n={n} S={s} causal={causal} lb={lb} docs={docs} window={window} "
            f"per_document={per_document} {rotate}")
    assert out.shape == ql.shape and lse.shape == ql.shape[:3], what
    want = cplib.shard(mesh, list(ref), [2] * 5, balancer)
    for label, got, w in zip(("out", "lse", "dq", "dk", "dv"),
                             (out, lse, ql.grad, kl.grad, vl.grad), want):
        assert_close(got, w, **TOL, what=f"{label} [{what}]")


_OP_CASES = [  # (S, causal, lb, documents, window, per_document, rotate)
    (16, True, True, [0, 5, 11, 16], None, False, "p2p"),
    (16, True, False, None, 3, False, "alltoall"),
    (13, True, True, [0, 4, 13], 4, False, "p2p"),          # uneven pieces
    (14, True, True, [0, 6, 7, 14], None, True, "p2p"),     # head-tail in every document
    (12, False, False, [0, 7, 12], (2, 1), False, "allgather"),
    (11, False, True, None, (None, 2), False, "p2p"),
]


def _check_ops() -> int:
    mesh = _mesh()
    for seed, case in enumerate(_OP_CASES):
        _op_case(mesh, *case, seed=10 * seed)
    return len(_OP_CASES)


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _check_context() -> int:
    """context_parallel(..., ulysses_degree=2) with documents (cu_seqlens or
    position_ids) and windows: the handle's unshard of out and of the
    gradients against the reference."""
    mesh = _mesh()
    checks = 0
    cases = [  # (S, load_balance, documents, window, as position_ids, compiled)
        (16, True, [0, 9, 16], None, False, False),
        (15, False, None, 3, False, False),
        (18, "per_document", [0, 5, 18], 6, True, True),
        (17, True, [0, 2, 17], (4, None), False, False),
    ]
    for seed, (s, lb, docs, window, as_pos, compiled) in enumerate(cases):
        torch._dynamo.reset()
        compiled = compiled and dist.get_world_size() == 4  # the USP path; one compile
        fn = torch.compile(_sdpa, backend="aot_eager", fullgraph=True) if compiled else _sdpa
        q, k, v, cot = _inputs(s, 100 + 10 * seed)
        ref = masked_reference(q, k, v, cot, visible(s, causal=True, cu_seqlens=docs,
                                                      window=window))
        extra = {}
        if docs is not None and as_pos:
            extra["position_ids"] = torch.cat([torch.arange(b - a)
                                               for a, b in zip(docs, docs[1:])])
        elif docs is not None:
            extra["cu_seqlens"] = torch.tensor(docs)
        bufs = [t.clone() for t in (q, k, v, cot)]
        with cplib.context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2] * 4,
                                    load_balance=lb, ulysses_degree=U, window=window,
                                    **extra) as cp:
            got = sharded_fwd_bwd(cp, bufs, fn)
        for label, g, w in zip(("out", "dq", "dk", "dv"), got, (ref[0],) + ref[2:]):
            assert_close(g, w, **TOL, what=f"context {label} [S={s} lb={lb} docs={docs} "
                                           f"window={window} compiled={compiled}]")
        checks += 1
    return checks


class _Attn(nn.Module):
    def forward(self, q, k, v):
        return _sdpa(q, k, v)


def _check_style() -> int:
    """_ContextParallel with ulysses_degree=2, a window and per-batch documents."""
    mesh, n = _mesh(), dist.get_world_size()
    attn = parallelize_module(_Attn(), mesh, cplib._ContextParallel(
        seq_dim=2, attention_type=cplib._ContextParallel.AttentionType.SDPA,
        ulysses_degree=U, window=5))
    checks = 0
    cplib._enable_context_parallel_dispatcher()
    try:
        for seed, (s, docs, per_document) in enumerate(((16, [0, 3, 16], False),
                                                        (14, [0, 8, 14], True))):
            q, k, v, cot = _inputs(s, 200 + 10 * seed)
            ref = masked_reference(q, k, v, cot, visible(s, causal=True, cu_seqlens=docs,
                                                          window=5))
            balancer = cplib.usp_load_balancer(s, n, U,
                                               cu_seqlens=docs if per_document else None)
            ql, kl, vl, cl = cplib._context_parallel_shard(mesh, [q, k, v, cot], [2] * 4,
                                                           balancer)
            ql, kl, vl = (t.requires_grad_(True) for t in (ql, kl, vl))
            with cplib.attention_documents(torch.tensor(docs), per_document=per_document):
                out = attn(ql, kl, vl)
            out.backward(cl)
            got = cplib.context_parallel_unshard(mesh, [out.detach(), ql.grad, kl.grad,
                                                        vl.grad], [2] * 4, balancer)
            for label, g, w in zip(("out", "dq", "dk", "dv"), got, (ref[0],) + ref[2:]):
                assert_close(g, w, **TOL, what=f"_ContextParallel {label} [S={s} docs={docs} "
                                               f"per_document={per_document}]")
            checks += 1
    finally:
        cplib._disable_context_parallel_dispatcher()
    return checks


def _check_bad() -> list[str]:
    """Bad documents/lengths raise ValueError naming the value, on every rank
    alike, before any exchange (the groups still work afterwards)."""
    mesh, n = _mesh(), dist.get_world_size()
    groups = usp_groups(mesh.get_group(), U)
    ring = groups.ring_group or cplib.ulysses.op._self_group()
    q = torch.randn(1, 4, 4, 8, dtype=torch.float64)
    messages = []
    for kwargs in (dict(seq_len=6 * n),                           # not this layout's lengths
                   dict(cu_seqlens=torch.tensor([0, 3, 2, 4 * n])),
                   dict(per_document=True, cu_seqlens=torch.tensor([0, 4 * n])),
                   dict(window=(-1, 2))):
        with pytest.raises(ValueError) as info:
            cplib.usp_sdpa(q, q, q, groups.ulysses_group, ring, is_causal=True, **kwargs)
        messages.append(str(info.value))
    with pytest.raises(ValueError) as info:
        with cplib.attention_documents():
            pass
    messages.append(str(info.value))
    out, _ = cplib.usp_sdpa(q, q, q, groups.ulysses_group, ring, is_causal=True, window=2)
    assert out.shape == q.shape
    return messages


def _check_all() -> list:
    return [_check_ops(), _check_context(), _check_style(), _check_bad()]


@pytest.mark.parametrize("world_size", [2, 4])
def test_usp_documents_and_windows(ranks, world_size):
    results = ranks(world_size).run(_check_all)
    assert [r[:3] for r in results] == [[len(_OP_CASES), 4, 2]] * world_size
    messages = results[0][3]
    assert all(r[3] == messages for r in results)  # the same error on every rank
    n = world_size
    assert f"seq_len={6 * n} over {n // U} ring positions x {U} Ulysses ranks (sequential " \
        "layout) gives this Ulysses group pieces of [6, 6] rows, but q has 4 and k/v 4" \
        in messages[0]
    assert "cu_seqlens must be strictly increasing, got 3 then 2" in messages[1]
    assert "per_document=True (head-tail inside every document) needs cu_seqlens and seq_len" \
        in messages[2]
    assert "window=(-1, 2) must be non-negative" in messages[3]
    assert "pass cu_seqlens or position_ids (one)" in messages[4]


def test_usp_layout_is_head_tail_over_ring_positions_when_it_divides():
    # The composed layout reduces to head-tail over N/U then the N-way cut.
    for s, n, u in ((16, 4, 2), (24, 4, 2), (16, 4, 4), (8, 2, 1)):
        want = cplib._HeadTailLoadBalancer(s, n // u, "cpu")._generate_indices()
        got = cplib.usp_load_balancer(s, n, u)
        assert torch.equal(got._generate_indices(), want), (s, n, u)
        assert got.lengths() == [s // n] * n
    # Uneven: each ring shard is cut in U pieces within a row of each other.
    lb = cplib.usp_load_balancer(13, 4, 2)
    assert lb._generate_indices()[0].tolist() == [0, 1, 2, 3, 10, 11, 12, 4, 5, 6, 7, 8, 9]
    assert lb.lengths() == [4, 3, 3, 3]
    with pytest.raises(ValueError, match="shorter than the context-parallel world size 4"):
        cplib.usp_load_balancer(3, 4, 2)
