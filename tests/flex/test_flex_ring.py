"""The flex ring (``set_rotate_method("p2p" | "alltoall")`` with
``_ContextParallel(seq_dim=2, AttentionType.FLEX)``) against flex_attention
on the whole sequence in one process, at world sizes 1, 2 and 4 (gloo, CPU).

Compared (fp32 CP against the float64 whole-sequence computation, torch's
flex CP tolerances atol 2e-6, rtol 1e-5; two fp32 computations that sum in
different orders each err about 1e-6 from the truth, so against each other
they would need twice that): the
output, the lse and the gradients of q, k and v, for causal, 28 packed
documents (random lengths, as torch's tests), an odd number of documents,
sliding-window and prefix-LM masks, with no balancer, head-tail, PTRR and
per-document head-tail, GQA, and a score_mod that reads a captured tensor
and the query/key positions. Both sides run flex's own dense implementation
(eager; torch's CPU backward guard lifted inside the rank processes, see
flex_cases.cpu_flex_grads); one case of each world size runs the CP model
under ``torch.compile(backend="aot_eager", fullgraph=True)``. The checks of
what the plan leaves out (traffic, calls), of compiling to one graph and of
bad input are in test_flex_ring_plan.py. ``CPLIB_QUICK_TESTS=1`` runs
one eager case and the compiled ones.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask

import cplib
from cplib import _context_parallel_shard
from flex_cases import (balancer, causal, cpu_flex_grads, document_causal, document_lengths,
                        flex_reference, mesh, prefix_lm, randn, rotate, sliding_window)
from flex_cases import shared_model as _model
from harness import assert_close

TOL = dict(atol=2e-6, rtol=1e-5)
QUICK = os.environ.get("CPLIB_QUICK_TESTS") == "1"
DIM = 16


def _mask_mod(kind: str, B: int, S: int, docs: int):
    """The case's mask_mod on global positions and its document lengths."""
    if kind == "causal":
        return causal, None
    if kind == "window":
        return sliding_window(S // 10), None
    if kind == "prefix":
        return prefix_lm(S // 4 + 13), None
    unit = 2 * dist.get_world_size() if kind == "documents_chunked" else 1
    lengths = document_lengths(B, S, docs, unit, seed=S + B + docs + unit)
    return document_causal(lengths), lengths


def _positional_score_mod(S: int):
    """A score_mod reading a captured tensor at the key's global position and
    the distance between global positions (wrong unless both are global)."""
    bias = randn((S,), 7)

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx] + 0.01 * (q_idx - kv_idx)
    return biased


def _check(kind: str, B: int, S: int, balancers: tuple[str, ...], *, heads=(2, 2),
           score: bool = False, block: int = 64, docs: int = 28, compiled: bool = False,
           method: str = "p2p") -> list[str]:
    """Runs one (mask, B, S) with each balancer on this rank; returns what it checked."""
    mask_mod, lengths = _mask_mod(kind, B, S, docs)
    score_mod = _positional_score_mod(S) if score else None
    hq, hkv = heads
    q, k, v = randn((B, hq, S, DIM), 1), randn((B, hkv, S, DIM), 2), randn((B, hkv, S, DIM), 3)
    cot_out, cot_lse = randn((B, hq, S, DIM), 4), randn((B, hq, S), 5)
    full_mask = create_block_mask(mask_mod, B, 1, S, S, device="cpu", BLOCK_SIZE=block)
    done = []
    with cpu_flex_grads(), rotate(method):
        ref = flex_reference(q, k, v, full_mask, score_mod, hq != hkv, cot_out, cot_lse)
        for lb_kind in balancers:
            lb = balancer(lb_kind, S, full_mask, lengths)
            with torch.compiler.set_stance("force_eager"):
                *local, mask = _context_parallel_shard(
                    mesh(), [q, k, v, cot_out, cot_lse, full_mask], [2] * 5 + [0], lb)
            lq, lk, lv, l_cot_out, l_cot_lse = local
            for t in (lq, lk, lv):
                t.requires_grad_(True)
            out, aux = _model(compiled)(lq, lk, lv, score_mod=score_mod, block_mask=mask,
                                        enable_gqa=hq != hkv, return_aux=AuxRequest(lse=True))
            torch.autograd.backward([out, aux.lse], [l_cot_out, l_cot_lse])
            want = cplib.shard(mesh(), ref, [2] * 5, lb)
            what = (f"{kind} B={B} S={S} docs={docs if lengths else '-'} lb={lb_kind} "
                    f"heads={hq}/{hkv} score_mod={score} compiled={compiled} {method}")
            for name, got, exp in zip(("out", "lse", "dq", "dk", "dv"),
                                      (out, aux.lse, lq.grad, lk.grad, lv.grad), want):
                assert_close(got.detach().double(), exp.double(), what=f"{what}: {name}", **TOL)
            done.append(what)
    return done


def _run(pool, *args, **kwargs) -> None:
    done = pool.run(_check, *args, **kwargs)
    assert len(done[0]) == len(args[3]) and all(d == done[0] for d in done), done


# (kind, B, S, balancers, options). Every mask runs with and without a
# balancer across world sizes 2 and 4; GQA with a positional score_mod runs
# at both (prefix-LM eagerly at 4, causal compiled at 2 and 4).
CASES_2 = [
    ("causal", 1, 512, ("none", "head_tail", "ptrr"), {}),
    ("documents", 2, 512, ("none", "ptrr"), {}),
    ("documents_chunked", 1, 512, ("per_document_head_tail",), {"docs": 7}),
    ("window", 1, 512, ("none", "head_tail"), {"block": 32}),
    ("prefix", 1, 512, ("none", "head_tail"), {"method": "alltoall"}),
    # The all-gather also gives score_mod global positions (torch's does not).
    ("causal", 1, 512, ("head_tail",), {"heads": (4, 2), "score": True, "method": "allgather"}),
]
CASES_4 = [
    ("causal", 1, 512, ("head_tail",), {"block": 32}),
    # Two rows, each permuted its own way (head-tail at 4: the causal case).
    ("documents_chunked", 2, 512, ("per_document_head_tail",), {}),
    ("window", 1, 1024, ("none",), {"block": 32}),
    ("prefix", 1, 512, ("ptrr",), {"heads": (4, 2), "score": True, "block": 32}),
]
if QUICK:  # CPLIB_QUICK_TESTS=1 (other torch releases): one eager case, the compiled ones
    CASES_2, CASES_4 = CASES_2[:1], []


def _case_id(case) -> str:
    kind, B, _, lbs, opts = case
    options = (f"{k}={v}".replace(", ", "x") for k, v in opts.items())
    return "-".join([kind, f"B{B}", *lbs, *options])


@pytest.mark.parametrize("case", CASES_2, ids=_case_id)
def test_flex_ring_world_2(ranks, case):
    kind, B, S, lbs, opts = case
    _run(ranks(2), kind, B, S, lbs, **opts)


@pytest.mark.parametrize("case", CASES_4, ids=_case_id)
def test_flex_ring_world_4(ranks, case):
    kind, B, S, lbs, opts = case
    _run(ranks(4), kind, B, S, lbs, **opts)


def test_flex_ring_world_1(ranks):
    """A world of one: the plan is its own blocks, nothing is exchanged."""
    _run(ranks(1), "documents", 1, 256, ("none",), score=True)


@pytest.mark.parametrize("world", [2, 4])
def test_flex_ring_compiled(ranks, world):
    """The CP model under torch.compile(fullgraph=True) (aot_eager)."""
    _run(ranks(world), "causal", 1, 512, ("head_tail",), heads=(4, 2), score=True,
         compiled=True, block=32 if world == 4 else 64)


def _check_two_masks_compiled() -> list[str]:
    """One compiled model, then a batch with another mask: the recompile
    sees each step's query span change (head-tail causal, then documents),
    which dynamo must not turn into symbolic lengths inside flex_attention."""
    return [what for kind in ("causal", "documents")
            for what in _check(kind, 1, 512, ("head_tail",), compiled=True, block=64)]


def test_flex_ring_compiled_recompiles_for_another_mask(ranks):
    done = ranks(2).run(_check_two_masks_compiled)
    assert len(done[0]) == 2 and all(d == done[0] for d in done), done


def test_flex_ring_backward_without_score_mod_calls_flex_backward_directly():
    """Without a score_mod the backward calls flex's own backward op with the
    merged output (no block's forward runs again) wherever dynamo traces
    that call (torch >= 2.13); with one, or on torch 2.11, each visited
    block's forward is recomputed under autograd. The gradient matrices
    above run whichever this torch takes."""
    from types import SimpleNamespace

    from cplib.flex import ring

    direct = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 13)
    assert ring._DIRECT_BACKWARD_TRACEABLE == direct
    no_steps = SimpleNamespace(steps=())
    assert ring.FlexRingCall(no_steps, None, None, False, None).direct_backward == direct
    assert not ring.FlexRingCall(no_steps, _positional_score_mod(8), None, False,
                             None).direct_backward
