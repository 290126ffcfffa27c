"""The flex ring in float64 at float64 precision: out, lse and the gradients
of q, k and v against flex_attention on the whole sequence in one process,
both in float64, within 1e-12 (what the all-gather gives, and the ring
without a score_mod).

With a score_mod the ring's backward recomputes each visited block under
autograd and passes the gradient of the block's lse (cplib/flex/ring.py:
_block_grads). flex's fake kernel types that lse float32 while its dense
implementation returns float64, and a cast to the traced dtype rounded the
gradient to float32: dq and dk were off by about 5e-8, eagerly (flex
traces its own call) and compiled. Causal with head-tail (every step but
the first a span of the query rows) and a score_mod that reads a captured
tensor at global positions, with GQA; at world sizes 2 and 4, eager, and
compiled (aot_eager) at 2.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask

import cplib
from cplib import _context_parallel_shard
from flex_cases import balancer, causal, cpu_flex_grads, flex_reference, mesh, randn, rotate
from flex_cases import shared_model as _model
from harness import assert_close

TOL = dict(atol=1e-12, rtol=1e-12)
S, DIM, HEADS = 256, 16, (4, 2)


def _score_mod():
    bias = randn((S,), 7, torch.float64)

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx] + 0.01 * (q_idx - kv_idx)
    return biased


def _check(score: bool, compiled: bool, block: int) -> list[str]:
    f64 = torch.float64
    score_mod = _score_mod() if score else None
    hq, hkv = HEADS
    q, k, v = (randn((1, h, S, DIM), seed, f64) for h, seed in ((hq, 1), (hkv, 2), (hkv, 3)))
    cot_out, cot_lse = randn((1, hq, S, DIM), 4, f64), randn((1, hq, S), 5, f64)
    full_mask = create_block_mask(causal, 1, 1, S, S, device="cpu", BLOCK_SIZE=block)
    with cpu_flex_grads(), rotate("p2p"):
        want = flex_reference(q, k, v, full_mask, score_mod, True, cot_out, cot_lse, f64)
        lb = balancer("head_tail", S, full_mask, None)
        with torch.compiler.set_stance("force_eager"):
            *local, mask = _context_parallel_shard(
                mesh(), [q, k, v, cot_out, cot_lse, full_mask], [2] * 5 + [0], lb)
        lq, lk, lv, l_cot_out, l_cot_lse = local
        for t in (lq, lk, lv):
            t.requires_grad_(True)
        out, aux = _model(compiled)(lq, lk, lv, score_mod=score_mod, block_mask=mask,
                                    enable_gqa=True, return_aux=AuxRequest(lse=True))
        torch.autograd.backward([out, aux.lse], [l_cot_out, l_cot_lse])
        want = cplib.shard(mesh(), want, [2] * 5, lb)
    what = f"float64 score_mod={score} compiled={compiled} block={block}"
    for name, got, exp in zip(("out", "lse", "dq", "dk", "dv"),
                              (out, aux.lse, lq.grad, lk.grad, lv.grad), want):
        assert got.dtype == torch.float64, f"{what}: {name} is {got.dtype}"
        assert_close(got.detach(), exp, what=f"{what}: {name}", **TOL)
    return [what]


@pytest.mark.parametrize("world,compiled", [(2, False), (4, False), (2, True)],
                         ids=["world2", "world4", "world2-compiled"])
def test_score_mod_backward_in_float64(ranks, world, compiled):
    done = ranks(world).run(_check, True, compiled, 32)
    assert all(d == done[0] for d in done) and len(done[0]) == 1, done


def test_backward_without_score_mod_in_float64(ranks):
    """The direct backward (flex's backward op on the merged output)."""
    done = ranks(2).run(_check, False, False, 64)
    assert all(d == done[0] for d in done) and len(done[0]) == 1, done
