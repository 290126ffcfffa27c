"""What a ring's ranks settle before its first exchange, and what its backward
takes from its forward (issue 34, section 3):

- The CUDA backend is resolved from inputs every rank agrees on: the longest
  shards of the layouts (after the handshake and the positions' gather), the
  heads and head dims. A rank that holds no K/V rows (explicit positions) used
  to keep "auto" and raise in the middle of the ring while the others waited;
  now ``ring_debug_block_shape`` (the shape the backend is resolved from,
  computed on every device) is the same on every rank, that rank included.
- The backward reached through autograd takes the documents, positions,
  lengths and backend its forward agreed on (the forward's record,
  csrc/torch/ring/ring_agreed.h) and re-checks nothing alone: cu_seqlens or
  positions changed in place on one rank between the forward and the
  backward (made invalid there) used to raise on that rank only and leave
  the other waiting in the ring; now every rank finishes with the gradients
  of the forward it ran.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import cplib
from cplib.comm.native import ops
from harness import assert_close
from ring_cases import global_tensor
from ring_mask_cases import masked_reference, visible

TOL = dict(atol=1e-10, rtol=1e-10)


def _block_shape_with_an_empty_rank() -> list[int]:
    # Rank 0 holds every key; rank 1 none. Queries: 5 on rank 0, 3 on rank 1.
    rank = dist.get_rank()
    s = 8
    kvpos = torch.arange(s) if rank == 0 else torch.arange(0)
    qpos = torch.arange(5) if rank == 0 else torch.arange(5, 8)
    q = global_tensor((1, 4, s, 16), torch.float64, 1)[:, :, qpos]
    k = global_tensor((1, 2, s, 16), torch.float64, 2)[:, :, kvpos]
    v = global_tensor((1, 2, s, 8), torch.float64, 3)[:, :, kvpos]
    out, _ = cplib.ring_sdpa(q, k, v, dist.group.WORLD, is_causal=True, q_positions=qpos,
                             kv_positions=kvpos)
    ref, _, _, _, _ = masked_reference(global_tensor((1, 4, s, 16), torch.float64, 1),
                                       global_tensor((1, 2, s, 16), torch.float64, 2),
                                       global_tensor((1, 2, s, 8), torch.float64, 3),
                                       torch.zeros(1, 4, s, 8, dtype=torch.float64),
                                       visible(s, causal=True))
    assert_close(out, ref[:, :, qpos], **TOL, what="out")
    return list(ops.ring_debug_block_shape())


def test_every_rank_resolves_from_the_same_shape(ranks):
    shapes = ranks(2).run(_block_shape_with_an_empty_rank)
    # [batch, q heads, longest q shard, longest k/v shard, head dim, v head dim]
    assert shapes == [[1, 4, 5, 8, 16, 8]] * 2, shapes


S = 16
DOCS = [0, 6, 16]


def _backward_after_a_change_on_one_rank(what: str) -> None:
    """One causal fwd+bwd over documents (sequential shards of 8 rows, or the
    same rows as explicit positions); between the forward and the backward
    rank 1 breaks its own cu_seqlens or positions in place."""
    rank, n = dist.get_rank(), dist.get_world_size()
    rows = torch.arange(rank * S // n, (rank + 1) * S // n)
    q, k, v, cot = (global_tensor((1, 2, S, 8), torch.float64, seed) for seed in range(4))
    ql, kl, vl = (t[:, :, rows].clone().requires_grad_(True) for t in (q, k, v))
    cu = torch.tensor(DOCS)
    pos = dict(q_positions=rows.clone(), kv_positions=rows.clone()) if what == "positions" \
        else dict(seq_len=S)
    out, _ = cplib.ring_sdpa(ql, kl, vl, dist.group.WORLD, is_causal=True, cu_seqlens=cu, **pos)
    if rank == 1:
        if what == "positions":
            pos["q_positions"].fill_(-1)  # negative: invalid
        else:
            cu[-1] = S - 1  # no longer ends at S: invalid
    out.backward(cot[:, :, rows])
    _, _, dq, dk, dv = masked_reference(q, k, v, cot, visible(S, causal=True, cu_seqlens=DOCS))
    for got, want, name in ((ql.grad, dq, "dq"), (kl.grad, dk, "dk"), (vl.grad, dv, "dv")):
        assert_close(got, want[:, :, rows], **TOL, what=name)


@pytest.mark.parametrize("what", ["cu_seqlens", "positions"])
def test_the_backward_takes_what_its_forward_agreed(ranks, what):
    ranks(2).run(_backward_after_a_change_on_one_rank, what)
