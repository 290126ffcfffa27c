"""Bad input to ring_sdpa and its backward: the ring's cases of the
bad-input matrix (tests/support/bad_input.py: every rank raises alike,
quickly, naming what is wrong), a rank on meta tensors beside real ones, the
fake kernel given real tensors beside meta ones, and the load balancers'
arguments."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import cplib
from bad_input import QUICK_S, TIMEOUT_S, check, names
from bad_input_ops import qkv
from cplib.comm.native import ops  # raises a kernel's error as its Python class
from harness import RankPool


@pytest.mark.parametrize("name", names("ring"))
def test_every_rank_raises_alike(name):
    check(name)


def test_fake_kernel_rejects_real_tensors_beside_meta():
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match="inputs mix the meta device"):
        ops.ring_sdpa(q, q, q, "0", cu_seqlens=torch.tensor([0, 16], device="meta"))


def test_load_balancers_name_bad_arguments():
    from cplib.ring.load_balancer import (
        AnyLengthPerDocumentLoadBalancer,
        _HeadTailLoadBalancer,
        _PerDocumentHeadTailLoadBalancer,
        _PTRRLoadBalancer,
    )

    with pytest.raises(ValueError, match=r"cu_seqlens=\[0, 10, 6, 16\] must be strictly "
                                         r"increasing .*document 1 \(\[10, 6\)\) has length -4"):
        AnyLengthPerDocumentLoadBalancer([0, 10, 6, 16], 2, "cpu")
    with pytest.raises(ValueError, match="seq_length must be an int >= 0, got -8"):
        _HeadTailLoadBalancer(-8, 2, "cpu")
    with pytest.raises(ValueError, match="world_size must be an int >= 1, got 0"):
        _HeadTailLoadBalancer(8, 0, "cpu")
    with pytest.raises(ValueError, match="document length .* got -4"):
        _PerDocumentHeadTailLoadBalancer([[8, -4]], 2, "cpu")
    with pytest.raises(ValueError, match="block_mask must be a flex attention BlockMask, got "
                                         "Tensor"):
        _PTRRLoadBalancer(torch.ones(1, 1, 8, 8), 2)
    # A valid one still shards as before.
    lb = AnyLengthPerDocumentLoadBalancer([0, 6, 16], 2, "cpu")
    assert sorted(lb._generate_indices()[0].tolist()) == list(range(16))


# ---------------------------------------------------------------- a rank on meta tensors


def _meta_beside_real() -> dict:
    """ring_sdpa with one rank on meta tensors and the other on CPU ones (both
    orders), a meta rank whose own argument is bad, every rank on meta
    tensors (shapes only, one handshake), and meta tensors under
    FakeTensorMode (no communication at all)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    rank = dist.get_rank()
    out = {}
    cases = {
        "meta-first": lambda g: "meta" if rank == 0 else "cpu",
        "meta-second": lambda g: "meta" if rank == 1 else "cpu",
    }
    for name, device_of in cases.items():
        g = dist.new_group([0, 1])
        q, k, v = (t.to(device_of(g)) for t in qkv(rank))
        start = time.monotonic()
        try:
            cplib.ring_sdpa(q, k, v, g, is_causal=True)
            out[name] = (None, "", 0.0)
        except Exception as exc:  # the outcome is what the test checks
            out[name] = (type(exc).__name__, str(exc), time.monotonic() - start)
    g = dist.new_group([0, 1])
    q, k, v = (t.to("meta" if rank == 0 else "cpu") for t in qkv(rank))
    try:
        cplib.ring_sdpa(q, k, v, g, scale=-1.0 if rank == 0 else None)
        out["meta-bad-scale"] = (None, "", 0.0)
    except Exception as exc:
        out["meta-bad-scale"] = (type(exc).__name__, str(exc), 0.0)
    g = dist.new_group([0, 1])
    q, k, v = (t.to("meta").requires_grad_() for t in qkv(rank))
    ops.handshake_debug_count(True)
    o, _ = cplib.ring_sdpa(q, k, v, g, is_causal=True)
    o.sum().backward()
    out["all-meta"] = (o.device.type, tuple(q.grad.shape), ops.handshake_debug_count(True))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fq = mode.from_tensor(torch.randn(1, 2, 8 + rank, 4))  # ranks disagree: never told
        fo, _ = cplib.ring_sdpa(fq, fq, fq, g, is_causal=True)
    out["fake"] = (tuple(fo.shape), ops.handshake_debug_count(True))
    return out


def test_a_rank_on_meta_tensors_fails_with_the_others():
    pool = RankPool(2, timeout_s=TIMEOUT_S)
    try:
        results = pool.run(_meta_beside_real)
    finally:
        pool.close()
    for name, meta_rank in (("meta-first", 0), ("meta-second", 1)):
        outcome = [r[name] for r in results]
        for rank, (cls, msg, seconds) in enumerate(outcome):
            assert cls == "ValueError", f"{name} rank {rank}: {cls}: {msg}"
            assert "ring_sdpa: ranks disagree on q.device type" in msg, msg
            assert f"rank {meta_rank}: meta" in msg, msg
            assert seconds < QUICK_S, f"{name} rank {rank} took {seconds:.1f} s"
        assert outcome[0][1] == outcome[1][1], outcome
    bad = [r["meta-bad-scale"] for r in results]
    assert all(cls == "ValueError" for cls, _, _ in bad), bad
    assert all("invalid input on rank 0" in msg and "scale=-1.0" in msg for _, msg, _ in bad), bad
    for r in results:
        assert r["all-meta"] == ("meta", (1, 2, 8, 4), 1), r["all-meta"]
        assert r["fake"][1] == 0, r["fake"]
