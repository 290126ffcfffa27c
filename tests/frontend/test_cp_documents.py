"""The drop-in front end with packed documents, sliding windows and any
sequence length: Hugging Face Llama under context_parallel at a prime S and
with packed documents (position_ids restarting at each document) against the
same model in one process; a window per call; shard / unshard of uneven
lengths; bad document arguments raising ValueError on every rank, and
``attention_documents`` (the module path's) refused in a region."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import cplib
from cplib import context_parallel
from cp_runs import sharded_fwd_bwd
from harness import assert_close
from model_cases import _check_llama_documents as _check_llama
from model_cases import _mesh
from ring_mask_cases import masked_reference, visible


def _causal_sdpa(window, q, k, v):
    if window is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with cplib.attention_window(window):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_hf_llama_prime_length_and_documents(ranks):
    pool = ranks(2)
    for s, lb, docs in ((1031, True, None), (1031, False, None),
                        (257, True, [0, 100, 101, 200, 257]),
                        (257, "per_document", [0, 100, 101, 200, 257])):
        counts = pool.run(_check_llama, s, lb, docs)
        assert counts[0] == counts[1] > 10


# ------------------------------------------------- window per call, shard


def _check_window_and_uneven(n_unused: int = 0) -> int:
    mesh = _mesh()
    n = dist.get_world_size()
    s = 13 * n + 3
    g = torch.Generator().manual_seed(7)
    q, k, v, cot = (torch.randn(1, 2, s, 8, generator=g, dtype=torch.float64) for _ in range(4))
    cu = [0, 5, 6, 2 * s // 3, s]
    checks = 0
    for lb in (True, False):
        for window, default in ((3, None), (None, (2, 1)), ((4, None), 9)):
            effective = window if window is not None else default
            ref = masked_reference(q, k, v, cot, visible(s, causal=True, cu_seqlens=cu,
                                                          window=effective))
            bufs = [t.clone() for t in (q, k, v, cot)]
            with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2] * 4, load_balance=lb,
                                  cu_seqlens=torch.tensor(cu), window=default) as cp:
                got = sharded_fwd_bwd(cp, bufs, functools.partial(_causal_sdpa, window))
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, (ref[0],) + ref[2:]):
                assert_close(a, b, atol=1e-10, rtol=1e-10,
                             what=f"{name} lb={lb} window={window} default={default}")
            checks += 1
    # Equal shards of an odd length (S = 7N): head-tail's two chunks per rank
    # are then unequal, which the ring learns from the length (it once
    # refused: "load_balanced needs even local lengths").
    s = 7 * n
    q, k, v, cot = (torch.randn(1, 2, s, 8, generator=g, dtype=torch.float64) for _ in range(4))
    ref = masked_reference(q, k, v, cot, visible(s, causal=True))
    bufs = [t.clone() for t in (q, k, v, cot)]
    with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2] * 4, load_balance=True) as cp:
        got = sharded_fwd_bwd(cp, bufs, functools.partial(_causal_sdpa, None))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, (ref[0],) + ref[2:]):
        assert_close(a, b, atol=1e-10, rtol=1e-10, what=f"{name} S={s}, odd equal shards")
    checks += 1
    # shard / unshard / context_parallel_unshard round trips at uneven lengths
    x = torch.arange(2 * (5 * n + 1)).view(2, 5 * n + 1)
    for lb in (None, cplib.AnyLengthHeadTailLoadBalancer(5 * n + 1, n, "cpu")):
        (xs,) = cplib.shard(mesh, [x], [1], lb)
        assert abs(xs.shape[1] - (5 * n + 1) / n) <= 2
        (back,) = cplib.unshard(mesh, [xs], [1], lb)
        assert torch.equal(back, x)
        (back,) = cplib.context_parallel_unshard(mesh, [xs], [1], lb)
        assert torch.equal(back, x)
        checks += 1
    return checks


@pytest.mark.parametrize("world_size", [2, 4])
def test_window_per_call_and_uneven_sharding(ranks, world_size):
    assert ranks(world_size).run(_check_window_and_uneven) == [9] * world_size


def _check_bad_documents() -> int:
    mesh = _mesh()
    n = dist.get_world_size()
    s = 8 * n
    ids = torch.zeros(1, s, dtype=torch.long)

    def enter(**kw):
        with context_parallel(mesh, buffers=[ids], buffer_seq_dims=[1], **kw):
            raise AssertionError("the context must not be entered")

    bad = [
        (dict(cu_seqlens=torch.tensor([0, 5, 3, s])), ValueError, "got 5 then 3 at index 2"),
        (dict(cu_seqlens=torch.tensor([0, s + 1])), ValueError, f"end at the sequence length {s}"),
        (dict(position_ids=torch.arange(1, s + 1)), ValueError, "position_ids must start at 0"),
        (dict(position_ids=torch.arange(s), cu_seqlens=torch.tensor([0, s])), ValueError,
         "not both"),
        (dict(position_ids=torch.stack([torch.arange(s), torch.arange(s) % 3])),
         NotImplementedError, "packed differently"),
        (dict(window=(-2, 0)), ValueError, r"window=\(-2, 0\) must be non-negative"),
        (dict(position_ids=torch.arange(s - 1)), ValueError, f"cover {s - 1} tokens"),
    ]
    for kw, exc, match in bad:
        with pytest.raises(exc, match=match):
            enter(**kw)
    # attention_documents is the _ContextParallel modules' way; a region's SDPA
    # call ignored it (attention ran across documents, 0.86 off): it raises.
    x = torch.randn(1, 2, s, 8)
    with context_parallel(mesh, buffers=[x], buffer_seq_dims=[2]):
        with cplib.attention_documents(torch.tensor([0, 3, s])):
            with pytest.raises(NotImplementedError, match="pass position_ids= or cu_seqlens="):
                F.scaled_dot_product_attention(x, x, x, is_causal=True)
    assert ids.shape == (1, s)
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == n
    assert cplib.cu_seqlens_from_position_ids(torch.tensor([0, 1, 2, 0, 0, 1])).tolist() == [
        0, 3, 4, 6]
    return len(bad)


@pytest.mark.parametrize("world_size", [2])
def test_context_parallel_bad_documents(ranks, world_size):
    assert ranks(world_size).run(_check_bad_documents) == [7] * world_size
