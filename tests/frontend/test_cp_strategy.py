"""``strategy="auto"`` in the front end (cplib/frontend/strategy_route.py),
on gloo ranks: context_parallel and _ContextParallel against the full
computation in one process (outputs and gradients), the Ulysses degree
chosen on entry from the attention's shape, the document placement chosen
and run where the call has documents, an explicit rotation set after
parallelize_module winning over the choice, and a bad strategy on one rank
raising on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.parallel import parallelize_module

import cplib
from cplib.strategy import choice as choice_mod
from cp_runs import dispatched, sharded_fwd_bwd
from harness import assert_close
from ring_cases import global_tensor, reference
from strategy_cases import CPU, TOL, compare, inputs, world_mesh


def _attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _check_context_auto() -> list[str]:
    """context_parallel(strategy=...): per-call rotation ("auto"), and the
    entry choice of the Ulysses degree from the attention's shape."""
    mesh, n = world_mesh(), dist.get_world_size()
    b, hq, hkv, s, d = 1, 4, 2, 8 * n, 8
    q, k, v, cot = inputs(b, hq, hkv, s, d, 30)
    ref = reference(q, k, v, cot, is_causal=True, scale=None)
    shape = cplib.AttentionShape(q_heads=hq, kv_heads=hkv, head_dim=d, dtype=torch.float64)
    chosen = []
    # CPU twice: the second context's choice is the cached one, and it still
    # shows in that context's explain.
    for strategy in (CPU, CPU, cplib.AutoStrategy(calibration="cpu", attention=shape),
                     cplib.AutoStrategy(calibration="cpu", attention=shape,
                                        families=("ulysses",))):
        bufs = [t.clone() for t in (q, k, v, cot)]
        with cplib.context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2] * 4,
                                    strategy=strategy) as cp:
            ql, kl, vl, cl = bufs
            for t in (ql, kl, vl):
                t.requires_grad_(True)
            _attention(ql, kl, vl).backward(cl)
            out = _attention(ql, kl, vl)  # a second call of one shape: no new choice
            got = cp.unshard([out.detach(), ql.grad, kl.grad, vl.grad], [2] * 4)
            for t in (ql, kl, vl):
                t.requires_grad_(False)
        compare(got, ref, f"context_parallel strategy={strategy}")
        made = cplib.explain(cp)
        assert len(made) == 1 and "| * |" in str(made[0])
        chosen.append(made[0].chosen.name)
    assert chosen[0] == chosen[1] and chosen[3] == f"ulysses U={n}"
    choice_mod.clear_caches()
    return chosen


def test_context_parallel_strategy_auto_matches_reference(ranks):
    per_rank = ranks(2).run(_check_context_auto)
    assert per_rank[0] == per_rank[1]


def _check_placement_chosen() -> list[str]:
    """Packed documents that fit one per rank: auto chooses the document
    placement on entry (nothing to exchange) and shards in it; a context
    already in the placement gets its rotation chosen per call. Outputs and
    gradients against the full computation within documents."""
    from ring_mask_cases import masked_reference, visible

    mesh, n = world_mesh(), dist.get_world_size()
    s, d = 16 * n, 8
    cu = [16 * r for r in range(n + 1)]  # one document per rank
    q, k, v, cot = inputs(1, 4, 2, s, d, 70)
    ref = masked_reference(q, k, v, cot, visible(s, causal=True, cu_seqlens=cu))
    shape = cplib.AttentionShape(q_heads=4, kv_heads=2, head_dim=d, dtype=torch.float64)
    chosen = []
    for options in (dict(strategy=cplib.AutoStrategy(calibration="cpu", attention=shape)),
                    dict(strategy=CPU, load_balance="placement")):
        bufs = [t.clone() for t in (q, k, v, cot)]
        with cplib.context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2] * 4,
                                    cu_seqlens=torch.tensor(cu), **options) as cp:
            assert isinstance(cp.load_balancer, cplib.DocumentPlacementLoadBalancer)
            got = sharded_fwd_bwd(cp, bufs, _attention)
        compare(got, ref, f"placement chosen by auto ({options})")
        chosen.append(cplib.explain(cp)[0].chosen)
    assert chosen[0].layout == chosen[1].layout == "placement", chosen
    choice_mod.clear_caches()
    return [c.name for c in chosen]


def test_auto_chooses_and_runs_the_document_placement(ranks):
    per_rank = ranks(2).run(_check_placement_chosen)
    assert per_rank[0] == per_rank[1]


class _Attn(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _auto_module(seed: int):
    """A causal SDPA module parallelized with strategy="auto", its inputs
    sharded head-tail, and a check of its output against one process."""
    mesh, n = world_mesh(), dist.get_world_size()
    q, k, v = (global_tensor((1, 4, 8 * n, 8), torch.float64, seed + i) for i in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    style = cplib._ContextParallel(seq_dim=2, attention_type=cplib._ContextParallel.AttentionType
                                   .SDPA, strategy=CPU)
    attn = parallelize_module(_Attn(), mesh, style)
    lb = cplib.HeadTailLoadBalancer(8 * n, n, "cpu")
    shards = cplib._context_parallel_shard(mesh, [q, k, v], [2, 2, 2], lb)

    def check(out, what):
        (full,) = cplib.context_parallel_unshard(mesh, [out], [2], lb)
        assert_close(full, want, what=what, **TOL)
    return style, attn, shards, check


def _check_module_auto() -> str:
    style, attn, shards, check = _auto_module(60)
    check(dispatched(attn, *shards), "_ContextParallel strategy=auto")
    assert [c.chosen.family for c in cplib.explain(style)] == ["ring"]
    choice_mod.clear_caches()
    return "ok"


def test_context_parallel_style_strategy_auto(ranks):
    assert ranks(2).run(_check_module_auto) == ["ok"] * 2


def _check_rotation_set_after_parallelizing() -> list[int]:
    """set_rotate_method("allgather") made after parallelize_module wins
    over strategy="auto" (no choice made) and the result is exact; back on
    the default rotation, auto chooses again."""
    from flex_cases import rotate

    style, attn, shards, check = _auto_module(80)
    try:
        with rotate("allgather"):
            check(dispatched(attn, *shards), "set_rotate_method after parallelize_module")
        assert cplib.explain(style) == []
        dispatched(attn, *shards)  # the default rotation again: auto chooses
        return [len(cplib.explain(style))]
    finally:
        choice_mod.clear_caches()


def test_rotation_set_after_parallelizing_wins_over_auto(ranks):
    assert ranks(2).run(_check_rotation_set_after_parallelizing) == [[1], [1]]


def _check_bad_strategy_on_one_rank() -> str:
    mesh, rank = world_mesh(), dist.get_rank()
    x = torch.randn(1, 2, 8 * dist.get_world_size(), 8)
    with pytest.raises(ValueError) as info:
        with cplib.context_parallel(mesh, buffers=[x], buffer_seq_dims=[2],
                                    strategy="fast" if rank == 1 else "auto"):
            pass
    return str(info.value)


def test_bad_strategy_on_one_rank_raises_on_every_rank(ranks):
    per_rank = ranks(2).run(_check_bad_strategy_on_one_rank)
    assert len(set(per_rank)) == 1 and "strategy='fast'" in per_rank[0]
