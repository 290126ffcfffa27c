"""The flex ring's plan and its edges (gloo, CPU): a rank receives exactly
the key blocks its queries see and computes one flex call per rank it
visits (checked against the dense mask), the plan is made once per mask and
reused by every call, the rotate method selects the path, a compiled model
is one graph, bf16 errs no more than 1.5x single-process bf16 flex, no mask
means every key, and bad input raises on every rank before any exchange.
"""

from __future__ import annotations

import unittest.mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.attention.flex_attention as fa
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, create_mask

import cplib
from cplib import _context_parallel_shard
from cplib.flex import plan as flex_plan
from cplib.flex.ring_ops import ring_bytes_received
from flex_cases import (balancer, causal, cp_model, cpu_flex_grads, document_causal,
                        document_lengths, mesh, randn, rotate, sliding_window)
from harness import assert_close
from flex_cases import flex_reference
from flex_cases import shared_model as _model

DIM = 16


def _shard(S: int, mask_mod, block: int, lb_kind: str = "none", lengths=None, heads=2,
           B: int = 1):
    full = create_block_mask(mask_mod, B, 1, S, S, device="cpu", BLOCK_SIZE=block)
    lb = balancer(lb_kind, S, full, lengths)
    tensors = [randn((B, heads, S, DIM), seed) for seed in (1, 2, 3)]
    with torch.compiler.set_stance("force_eager"):
        return lb, _context_parallel_shard(mesh(), [*tensors, full], [2, 2, 2, 0], lb)


def _dense_rows(mask_mod, S: int, lb) -> torch.Tensor:
    """This rank's rows of the dense mask, keys in the sharded order."""
    rank, n = dist.get_rank(), dist.get_world_size()
    dense = create_mask(mask_mod, 1, 1, S, S, device="cpu")[0, 0]
    if lb is not None:
        idx = lb._generate_indices()[0]
        dense = dense[idx][:, idx]
    L = S // n
    return dense[rank * L:(rank + 1) * L]


def _expected_rows(dense: torch.Tensor, block: int) -> tuple[int, int]:
    """(key rows this rank receives, flex calls it makes), from its dense
    mask rows: the blocks of other ranks' keys that some of our queries see."""
    rank, (L, S) = dist.get_rank(), dense.shape
    mine = dense.view(L, S // block, block).any(-1).any(0)
    owners = torch.arange(S // block) // (L // block)
    rows = int((mine & (owners != rank)).sum()) * block
    calls = len(set(owners[mine].tolist()))
    return rows, calls


def _expected_query_span(dense: torch.Tensor, src: int, block: int) -> tuple[int, int]:
    """The span of our query rows, in whole query blocks, that see any key
    of rank ``src``: the rows a step's call takes."""
    L = dense.shape[0]
    seen = dense[:, src * L:(src + 1) * L].reshape(L // block, -1).any(-1).nonzero().flatten()
    return int(seen[0]) * block, (int(seen[-1]) + 1) * block


def _check_traffic(cases) -> list[tuple[int, int]]:
    got = []
    model = cp_model()
    for kind, S, block, lb_kind in cases:
        lengths = document_lengths(1, S, 28, 1, seed=3) if kind == "documents" else None
        mask_mod = {"window": sliding_window(S // 16), "causal": causal,
                    "documents": document_causal(lengths) if lengths else None}[kind]
        lb, (q, k, v, mask) = _shard(S, mask_mod, block, lb_kind, lengths)
        shard = getattr(mask, flex_plan.SHARD_ATTR)
        dense = _dense_rows(mask_mod, S, lb)
        rows, calls = _expected_rows(dense, block)
        assert (shard.recv_rows, shard.calls) == (rows, calls), (kind, lb_kind, rows, calls)
        spans = [s.q_rows for s in shard.steps if s.compute]
        assert spans == [_expected_query_span(dense, s.src, block)
                         for s in shard.steps if s.compute], (kind, lb_kind, spans)
        with rotate("p2p"):
            ring_bytes_received(reset=True)
            model(q, k, v, block_mask=mask)
        row_bytes = 2 * k.shape[1] * DIM * k.element_size()
        assert ring_bytes_received() == rows * row_bytes, (kind, lb_kind)
        areas = [(s.q_rows[1] - s.q_rows[0]) * (s.recv_rows or shard.q_len)
                 for s in shard.steps if s.compute]
        got.append((rows, calls, areas))
    return got


def test_ring_receives_only_the_blocks_the_mask_needs(ranks):
    """World size 4: a sliding window (no balancer) gets about one window of
    the previous rank's keys and makes at most 2 calls; documents and
    causal layouts receive exactly what the dense mask says, and each call
    takes only the span of query rows that see the attended keys: under
    head-tail causal, every step but the first computes half a block's area
    (the earlier rank's front chunk for all our rows, or all of a later
    rank's keys for our back chunk)."""
    cases = [("window", 1024, 32, "none"), ("documents", 512, 32, "head_tail"),
             ("causal", 512, 32, "none"), ("causal", 512, 32, "head_tail")]
    got = ranks(4).run(_check_traffic, cases)
    window = [g[0][:2] for g in got]
    assert all(rows <= 256 // 2 and calls <= 2 for rows, calls in window), window
    assert window[0] == (0, 1)  # rank 0 has no earlier keys
    causal_none = [g[2] for g in got]
    assert [c for _, c, _ in causal_none] == [1, 2, 3, 4]  # a causal rank skips later ones
    for rank, (_, calls, areas) in enumerate(g[3] for g in got):
        assert calls == 4 and areas == [128 * 128] + [128 * 64] * 3, (rank, areas)


def _check_plan_reused() -> int:
    """Three calls (layers) on one sharded mask make no plan: the plan was
    made when the mask was sharded."""
    _, (q, k, v, mask) = _shard(256, causal, 32, "head_tail")
    shard = getattr(mask, flex_plan.SHARD_ATTR)
    steps = [s.mask for s in shard.steps]
    model = cp_model()
    forbid = unittest.mock.patch.object(flex_plan, "_gather_needs",
                                        side_effect=AssertionError("plan made again"))
    with rotate("alltoall"), forbid:
        out = q
        for _ in range(3):
            out = model(out, k, v, block_mask=mask)
    assert getattr(mask, flex_plan.SHARD_ATTR) is shard
    assert [s.mask for s in shard.steps] == steps
    return len(shard.steps)


def test_plan_is_made_once_per_mask(ranks):
    assert ranks(2).run(_check_plan_reused) == [2, 2]


def _check_selection_and_one_graph() -> list[str]:
    """"allgather" runs the all-gather, "p2p"/"alltoall" the ring; the
    compiled CP model is one graph with cplib's ops, the ring's exchange
    runs inside it."""
    from torch._dynamo.testing import CompileCounterWithBackend

    _, (q, k, v, mask) = _shard(256, causal, 32, "head_tail")
    seen = []
    for method, op in (("allgather", "flex_cp_allgather"), ("p2p", "flex_ring_begin")):
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(cp_model(), backend=counter, fullgraph=True)
        with cpu_flex_grads(), rotate(method):
            lq = q.clone().requires_grad_(True)
            ring_bytes_received(reset=True)
            out, aux = compiled(lq, k, v, block_mask=mask, return_aux=AuxRequest(lse=True))
            (out.sum() + aux.lse.sum()).backward()
        assert counter.frame_count == 1, f"{method}: {counter.frame_count} graphs"
        targets = {str(node.target) for node in counter.graphs[0].graph.nodes}
        assert any(t.startswith(f"cplib_c.{op}") for t in targets), (method, targets)
        assert (ring_bytes_received() > 0) == (method == "p2p"), method
        seen.append(method)
    return seen


def test_rotate_method_selects_the_path_and_compiles_to_one_graph(ranks):
    assert ranks(2).run(_check_selection_and_one_graph) == [["allgather", "p2p"]] * 2


def _check_bf16() -> list[str]:
    """bf16 ring against float64 truth: at most 1.5x the error of bf16 flex
    on the whole sequence in one process (out, lse and every gradient)."""
    S, B, H = 256, 1, 2
    full = create_block_mask(causal, B, 1, S, S, device="cpu", BLOCK_SIZE=32)
    # Values that bf16 holds exactly, so that every side starts from the same data.
    inputs = [randn((B, H, S, DIM), seed, torch.bfloat16).float() for seed in (1, 2, 3, 4)]
    inputs.append(randn((B, H, S), 5, torch.bfloat16).float())
    lb = balancer("head_tail", S, full, None)
    with cpu_flex_grads(), rotate("p2p"):
        truth = flex_reference(*inputs[:3], full, None, False, *inputs[3:])
        single = flex_reference(*inputs[:3], full, None, False, *inputs[3:], dtype=torch.bfloat16)
        with torch.compiler.set_stance("force_eager"):
            *local, mask = _context_parallel_shard(
                mesh(), [t.to(torch.bfloat16) for t in inputs] + [full], [2] * 5 + [0], lb)
        for t in local[:3]:
            t.requires_grad_(True)
        out, aux = _model(False)(*local[:3], block_mask=mask, return_aux=AuxRequest(lse=True))
        torch.autograd.backward([out, aux.lse], [local[3], local[4].float()])
    got = [out, aux.lse, local[0].grad, local[1].grad, local[2].grad]
    want, base = cplib.shard(mesh(), truth, [2] * 5, lb), cplib.shard(mesh(), single, [2] * 5, lb)
    report = []
    for name, g, t, s in zip(("out", "lse", "dq", "dk", "dv"), got, want, base):
        # Gradients of k and v are summed over every rank's queries: compare
        # the whole, not shards (a shard's own error varies more).
        err = (g.detach().double() - t).abs().max()
        err_single = (s.double() - t).abs().max()
        err, err_single = (torch.stack([x.reshape(())]) for x in (err, err_single))
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        dist.all_reduce(err_single, op=dist.ReduceOp.MAX)
        assert err <= 1.5 * err_single, f"{name}: bf16 ring error {err} > 1.5 x {err_single}"
        report.append(name)
    return report


def test_bf16_error_within_single_process_error(ranks):
    assert ranks(2).run(_check_bf16) == [["out", "lse", "dq", "dk", "dv"]] * 2


def _check_no_mask() -> int:
    """block_mask=None: every query sees every key (flex's default)."""
    S = 256
    inputs = [randn((1, 2, S, DIM), seed) for seed in (1, 2, 3, 4)] + [randn((1, 2, S), 5)]
    with cpu_flex_grads(), rotate("p2p"):
        want = flex_reference(*inputs[:3], None, None, False, *inputs[3:])
        local = cplib.shard(mesh(), inputs, [2] * 5)
        for t in local[:3]:
            t.requires_grad_(True)
        out, aux = _model(False)(*local[:3], return_aux=AuxRequest(lse=True))
        torch.autograd.backward([out, aux.lse], local[3:])
    want = cplib.shard(mesh(), want, [2] * 5)
    for name, g, w in zip("out lse dq dk dv".split(),
                          (out, aux.lse, *(t.grad for t in local[:3])), want):
        assert_close(g.detach().double(), w, atol=2e-6, rtol=1e-5, what=f"no mask: {name}")
    return 1


def test_no_block_mask_is_dense(ranks):
    assert ranks(2).run(_check_no_mask) == [1, 1]


def _raises(cls, match: str, fn, *args, **kwargs) -> str:
    with pytest.raises(cls, match=match) as info:
        fn(*args, **kwargs)
    return f"{cls.__name__}: {info.value}"


def _check_bad_input() -> list[str]:
    """Each bad call raises on every rank (on the ranks whose own input is
    fine too, through the handshake), before anything is exchanged; the
    next good call works. Among them: masks of two batches, a mask for
    another length and a score_mod that differs by rank, each on one rank;
    no mask where the last shard laid out another length."""
    rank = dist.get_rank()
    S = 256
    model = cp_model()
    lengths = document_lengths(1, S, 5, 1, seed=3)
    _, (q, k, v, doc_mask) = _shard(S, document_causal(lengths), 32)
    _, (_, _, _, mask) = _shard(S, causal, 32, "head_tail")
    msgs = []
    with rotate("p2p"):
        ring_bytes_received(reset=True)
        # Rank 1 passes another batch's mask: the two were planned apart.
        msgs.append(_raises(ValueError, "ring plan", model, q, k, v,
                            block_mask=mask if rank == 1 else doc_mask))
        # Only rank 1's key is bad; rank 0 learns it in the handshake.
        bad_k = k.double() if rank == 1 else k
        msgs.append(_raises(ValueError, "one dtype", model, q, bad_k, v, block_mask=mask))
        local = create_block_mask(causal, 1, 1, S // 2, S, device="cpu", BLOCK_SIZE=32)
        msgs.append(_raises(ValueError, "cplib did not shard", model, q, k, v, block_mask=local))
        msgs.append(_raises(NotImplementedError, "max.scores", model, q, k, v,
                            block_mask=mask, return_aux=AuxRequest(max_scores=True)))
        # Key blocks of 64 rows do not tile shards of 96: the all-gather's job.
        odd = create_block_mask(causal, 1, 1, 192, 192, device="cpu", BLOCK_SIZE=(32, 64))
        with torch.compiler.set_stance("force_eager"):
            *t, odd_mask = _context_parallel_shard(
                mesh(), [randn((1, 2, 192, DIM), i) for i in range(3)] + [odd], [2] * 3 + [0])
        msgs.append(_raises(NotImplementedError, "multiple of the mask's KV block size", model,
                            *t, block_mask=odd_mask))
        bias = torch.zeros(S, requires_grad=True)
        msgs.append(_raises(NotImplementedError, "bias", model, q, k, v, block_mask=mask,
                            score_mod=lambda s, b, h, qi, ki: s + bias[ki]))
        # Rank 1 passes the mask of a sequence twice as long.
        _, (_, _, _, long_mask) = _shard(2 * S, causal, 32)
        msgs.append(_raises(ValueError, "256 rows each", model, q, k, v,
                            block_mask=long_mask if rank == 1 else mask))
        # A score_mod that differs by rank, on the ring and on the all-gather.
        shift = _shift_a if rank == 0 else _shift_b
        msgs.append(_raises(ValueError, "score_mod", model, q, k, v, block_mask=mask,
                            score_mod=shift))
        with rotate("allgather"):
            msgs.append(_raises(ValueError, "score_mod", model, q, k, v, score_mod=shift))
        # No mask, and the last _context_parallel_shard laid out another length.
        _shard(2 * S, causal, 32, "head_tail")
        msgs.append(_raises(ValueError, "a sequence of 512", model, q, k, v))
        assert ring_bytes_received() == 0, "a bad call exchanged blocks"
        model(q, k, v, block_mask=mask)  # the ranks are still in step
    return [m.split(":")[0] for m in msgs]


def _shift_a(score, b, h, q_idx, kv_idx):
    return score + 0.5


def _shift_b(score, b, h, q_idx, kv_idx):
    return score + 0.25


def test_bad_input_raises_on_every_rank(ranks):
    kinds = ["ValueError"] * 3 + ["NotImplementedError"] * 3 + ["ValueError"] * 4
    assert ranks(2).run(_check_bad_input) == [kinds, kinds]


def _check_one_tensor_as_q_k_v() -> int:
    """model(x, x, x): the gradient of x sums its three roles, once each."""
    S = 256
    full = create_block_mask(causal, 1, 1, S, S, device="cpu", BLOCK_SIZE=32)
    x, cot = randn((1, 2, S, DIM), 1), randn((1, 2, S, DIM), 2)
    lb = balancer("head_tail", S, full, None)
    with cpu_flex_grads(), rotate("p2p"):
        xr = x.double().requires_grad_(True)
        fa.flex_attention(xr, xr, xr, block_mask=full).backward(cot.double())
        with torch.compiler.set_stance("force_eager"):
            lx, lcot, mask = _context_parallel_shard(mesh(), [x, cot, full], [2, 2, 0], lb)
        lx.requires_grad_(True)
        _model(False)(lx, lx, lx, block_mask=mask).backward(lcot)
    want, = cplib.shard(mesh(), [xr.grad], [2], lb)
    assert_close(lx.grad.double(), want, atol=2e-6, rtol=1e-5, what="grad of x")
    return 1


def test_one_tensor_as_query_key_and_value(ranks):
    assert ranks(2).run(_check_one_tensor_as_q_k_v) == [1, 1]
