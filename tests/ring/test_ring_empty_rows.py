"""Rows that see no key at all (explicit positions: the first query of each
document has no cached key of its own document) through ring_sdpa forward
AND backward on the CPU, fp64, world sizes 1 and 2: out 0, lse -inf, dq 0,
and dk/dv free of NaN (the block backward is fed lse +inf for those rows:
exp(score - (-inf)) was NaN). tests/ring/test_gpu_ring_masks.py runs the same on
a GPU in bf16 and fp16."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import cplib
from harness import assert_close
from ring_cases import global_tensor
from ring_mask_cases import visible


def _check(s: int = 11) -> int:
    rank, n = dist.get_rank(), dist.get_world_size()
    docs = [0, 4, s]
    q_rows = torch.arange(s)
    kv_rows = torch.tensor([p for p in range(s) if p not in docs[:-1]])  # no document start
    see = visible(s, causal=True, cu_seqlens=docs)[:, kv_rows]
    q, cot = (global_tensor((1, 2, s, 8), torch.float64, i) for i in (1, 2))
    k, v = (global_tensor((1, 1, kv_rows.numel(), 8), torch.float64, i) for i in (3, 4))
    qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
    scores = (qr @ kr.transpose(-1, -2) * 8 ** -0.5).masked_fill(~see, float("-inf"))
    live = see.any(-1)
    probs = torch.softmax(scores[:, :, live], -1)
    want_out = torch.zeros(1, 2, s, 8, dtype=torch.float64)
    want_out[:, :, live] = probs @ vr
    want_out.backward(cot)
    want_lse = torch.logsumexp(scores.detach(), -1)
    qi, ki = q_rows.tensor_split(n)[rank], torch.arange(kv_rows.numel()).tensor_split(n)[rank]
    ql, kl, vl = (t[:, :, i].clone().requires_grad_(True) for t, i in ((q, qi), (k, ki), (v, ki)))
    out, lse = cplib.ring_sdpa(ql, kl, vl, dist.group.WORLD, is_causal=True,
                               cu_seqlens=torch.tensor(docs), q_positions=q_rows[qi],
                               kv_positions=kv_rows[ki])
    out.backward(cot[:, :, qi])
    assert_close(out, want_out[:, :, qi], atol=1e-12, rtol=1e-12, what="out")
    assert_close(lse, want_lse[:, :, qi], atol=1e-12, rtol=1e-12, what="lse")
    assert_close(ql.grad, qr.grad[:, :, qi], atol=1e-12, rtol=1e-12, what="dq")
    assert bool((ql.grad[:, :, ~live[qi]] == 0).all()), "dq of a row that sees nothing"
    dk, dv = kl.grad.clone(), vl.grad.clone()
    assert_close(dk, kr.grad[:, :, ki], atol=1e-12, rtol=1e-12, what="dk")
    assert_close(dv, vr.grad[:, :, ki], atol=1e-12, rtol=1e-12, what="dv")
    return int((~live[qi]).sum())


@pytest.mark.parametrize("world_size", [1, 2])
def test_rows_that_see_no_key_forward_and_backward(ranks, world_size):
    assert sum(ranks(world_size).run(_check)) == 2  # the two documents' first queries
