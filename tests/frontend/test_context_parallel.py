"""The drop-in front end: options, context_parallel, _ContextParallel,
SDPA dispatch (its buffers, sharding and bad input: test_cp_buffers.py).

Checks that exercise the front end alone run against ``cp_reference`` (an
all-gather stand-in for the ring op with the same signature); the SDPA matrix
runs against cplib's native ring op."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

import cplib
from cp_reference import CALLS, use_ring
from cplib import (
    _CausalBehavior,
    _context_parallel_shard,
    _ContextParallel,
    _cp_options,
    _disable_context_parallel_dispatcher,
    _enable_context_parallel_dispatcher,
    _HeadTailLoadBalancer,
    _is_causal_behavior,
    _RotateMethod,
    context_parallel,
    context_parallel_unshard,
    set_rotate_method,
)
from harness import assert_close

# Upstream's matrix of cases (dtypes, causal, rotations, load balancing) at a
# smaller shape than its rand(8, 8, 1024 * ws, 32): exactness does not depend
# on the size, and the full shape cost 3 minutes of CI on 2 cores.
# CPLIB_QUICK_TESTS=1 shrinks it further for the other torch releases.
QUICK = os.environ.get("CPLIB_QUICK_TESTS") == "1"
MATRIX_SHAPE = (2, 4, 128, 16) if QUICK else (4, 4, 256, 32)
ROTATIONS = ("p2p", "alltoall", "allgather")


def _mesh() -> DeviceMesh:
    return DeviceMesh("cpu", list(range(dist.get_world_size())))


def _rand(shape, seed, dtype=torch.float32):
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


class _Attention(nn.Module):
    """A leaf that calls SDPA, for the ``_ContextParallel`` entry point."""

    def __init__(self, is_causal: bool):
        super().__init__()
        self.is_causal = is_causal

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.is_causal)


def _reset_options() -> None:
    # Rank processes outlive a test: every check starts from the defaults.
    _cp_options.enable_load_balance = True
    _cp_options.rotate_method = _RotateMethod.P2P


@pytest.fixture(autouse=True)
def _default_options():
    yield
    _reset_options()


# ------------------------------------------------------------------ options


def test_set_rotate_method_accepts_the_three_methods():
    for name, method in (("allgather", _RotateMethod.ALL_GATHER),
                         ("alltoall", _RotateMethod.ALL_TO_ALL), ("p2p", _RotateMethod.P2P)):
        set_rotate_method(name)
        assert _cp_options.rotate_method is method
    with pytest.raises(NotImplementedError, match="'ring'"):
        set_rotate_method("ring")


def test_is_causal_behavior_table():
    _cp_options.enable_load_balance = False
    assert _is_causal_behavior(0, 4, 0, False) is _CausalBehavior.NOT_IS_CAUSAL
    table = [[_CausalBehavior.IS_CAUSAL, _CausalBehavior.SKIP],
             [_CausalBehavior.IS_CAUSAL, _CausalBehavior.NOT_IS_CAUSAL]]
    for rank, row in enumerate(table):
        assert [_is_causal_behavior(rank, 2, i, True) for i in range(2)] == row
    _cp_options.enable_load_balance = True
    for rank in range(2):
        assert [_is_causal_behavior(rank, 2, i, True) for i in range(2)] == [
            _CausalBehavior.IS_CAUSAL, _CausalBehavior.NOT_IS_CAUSAL]


def test_exports_match_torch():
    import torch.distributed.tensor.experimental._context_parallel as upstream

    missing = [name for name in upstream.__all__ if not hasattr(cplib, name)]
    assert not missing, missing
    assert set(upstream.__all__) <= set(cplib.__all__)


# ------------------------------------------------------------- SDPA matrix


def _run_case(entry: str, q, k, v, go, is_causal: bool, load_balance: bool, rotate: str,
              forward_only: bool):
    """One matrix case; returns the unsharded (out, dq, dk, dv)."""
    mesh, n = _mesh(), dist.get_world_size()
    lb = _HeadTailLoadBalancer(q.shape[2], n, "cpu") if load_balance else None
    (local_go,) = cplib.shard(mesh, [go], [2], lb)
    _cp_options.enable_load_balance = load_balance
    set_rotate_method(rotate)
    if entry == "context":
        cq, ck, cv = (t.clone() for t in (q, k, v))
        with context_parallel(mesh, buffers=(cq, ck, cv), buffer_seq_dims=(2, 2, 2)):
            for t in (cq, ck, cv):
                t.requires_grad_(True)
            with torch.set_grad_enabled(not forward_only):
                out = F.scaled_dot_product_attention(cq, ck, cv, is_causal=is_causal)
            if not forward_only:
                out.backward(local_go)
            outs = context_parallel_unshard(mesh, [out.detach()], [2])
            if not forward_only:
                outs += context_parallel_unshard(mesh, [cq.grad, ck.grad, cv.grad], [2, 2, 2])
            for t in (cq, ck, cv):
                t.requires_grad_(False)
        return outs
    attn = parallelize_module(_Attention(is_causal), mesh,
                              _ContextParallel(seq_dim=2,
                                               attention_type=_ContextParallel.AttentionType.SDPA))
    _enable_context_parallel_dispatcher()
    try:
        cq, ck, cv = _context_parallel_shard(mesh, (q, k, v), (2, 2, 2), lb)
        for t in (cq, ck, cv):
            t.requires_grad_(not forward_only)
        with torch.set_grad_enabled(not forward_only):
            out = attn(cq, ck, cv)
        outs = context_parallel_unshard(mesh, [out.detach()], [2], lb)
        if not forward_only:
            out.backward(local_go)
            outs += context_parallel_unshard(mesh, [cq.grad, ck.grad, cv.grad], [2, 2, 2], lb)
        return outs
    finally:
        _disable_context_parallel_dispatcher()


def _check_sdpa_matrix(impl: str, shape: tuple[int, int, int, int], entries: tuple[str, ...],
                       rotations: tuple[str, ...], tol: dict) -> int:
    use_ring(impl)
    _reset_options()
    n = dist.get_world_size()
    b, h, s, d = shape
    q, k, v = (_rand((b, h, s * n, d), seed) for seed in (10, 11, 12))
    go = torch.randn((b, h, s * n, d), generator=torch.Generator().manual_seed(13))
    cases = 0
    for is_causal in (True, False):
        ref = [t.clone().requires_grad_(True) for t in (q, k, v)]
        ref_out = F.scaled_dot_product_attention(*ref, is_causal=is_causal)
        ref_out.backward(go)
        expect = [ref_out.detach()] + [t.grad for t in ref]
        for load_balance in ((True, False) if is_causal else (False,)):
            for rotate in rotations:
                for forward_only in (True, False):
                    for entry in entries:
                        got = _run_case(entry, q, k, v, go, is_causal, load_balance, rotate,
                                        forward_only)
                        what = (f"{impl} {entry} causal={is_causal} lb={load_balance} "
                                f"rotate={rotate} fwd_only={forward_only}")
                        for name, g, e in zip(("out", "dq", "dk", "dv"), got, expect):
                            assert_close(g, e, what=f"{what} {name}", **tol)
                        assert len(got) == (1 if forward_only else 4)
                        cases += 1
    return cases


@pytest.mark.parametrize("world_size", [2, 4])
def test_sdpa_matrix_native(ranks, world_size):
    cases = ranks(world_size).run(_check_sdpa_matrix, "native", MATRIX_SHAPE,
                                  ("context", "style"), ROTATIONS, dict(atol=2e-5, rtol=2e-4))
    assert cases == [3 * 3 * 2 * 2] * world_size


@pytest.mark.parametrize("world_size", [2])
def test_sdpa_matrix_front_end_reference(ranks, world_size):
    # The same plumbing against the all-gather stand-in: proves the front end
    # alone (layouts, options, both entry points, unshard) on a smaller shape.
    cases = ranks(world_size).run(_check_sdpa_matrix, "reference", (1, 2, 32, 8),
                                  ("context", "style"), ROTATIONS, dict(atol=2e-5, rtol=2e-4))
    assert cases == [3 * 3 * 2 * 2] * world_size


# ---------------------------------------------------------- dispatch paths


def _check_dispatch_paths(redispatch: bool) -> None:
    use_ring("reference")
    _reset_options()
    import cplib.frontend.mode_kept as mode_kept

    saved = mode_kept.redispatch
    if not redispatch:  # torch < 2.13: the MHA path patches F's SDPA for that call,
        # and a backward goes past autograd's torch-function check itself.
        mode_kept.redispatch = None
    try:
        _dispatch_paths()
    finally:
        mode_kept.redispatch = saved
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention


def _dispatch_paths() -> None:
    mesh, n, rank = _mesh(), dist.get_world_size(), dist.get_rank()
    name = mesh.get_group().group_name
    sdpa_ref = F.scaled_dot_product_attention  # taken before entering the context
    q, k, v = (_rand((1, 4, 8 * n, 8), s, torch.float64) for s in (1, 2, 3))
    k2, v2 = k[:, :2].contiguous(), v[:, :2].contiguous()
    k1, v1 = k[:, :1].contiguous(), v[:, :1].contiguous()
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    full_gqa = F.scaled_dot_product_attention(q, k2, v2, scale=0.3, enable_gqa=True)
    full_mqa = F.scaled_dot_product_attention(q, k1, v1, is_causal=True)  # broadcast, as torch
    bufs = [t.clone() for t in (q, k, v, k2, v2, k1, v1)]
    with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2] * 7, rotate_method="alltoall",
                          load_balance=True) as cp:
        lq, lk, lv, lk2, lv2, lk1, lv1 = bufs
        out = sdpa_ref(lq, lk, lv, is_causal=True)
        assert CALLS[-1] == dict(shape=(1, 4, 8, 8), kv_heads=4, group=name, is_causal=True,
                                 load_balanced=True, scale=None, rotate="alltoall", backend=None)
        assert_close(cp.unshard([out], [2])[0], full, atol=1e-12, rtol=1e-12, what="pre-taken")
        out = torch.nn.functional.scaled_dot_product_attention(lq, lk2, lv2, None, 0.0, False,
                                                               scale=0.3, enable_gqa=True)
        assert CALLS[-1]["kv_heads"] == 2 and CALLS[-1]["scale"] == 0.3
        assert_close(cp.unshard([out], [2])[0], full_gqa, atol=1e-12, rtol=1e-12, what="gqa")
        with pytest.raises(NotImplementedError, match="dropout_p=0.1"):
            F.scaled_dot_product_attention(lq, lk, lv, dropout_p=0.1)
        with pytest.raises(NotImplementedError, match=r"attn_mask \(got \(8, 8\)\)"):
            F.scaled_dot_product_attention(lq, lk, lv, attn_mask=torch.ones(8, 8, dtype=bool))
        with pytest.raises(ValueError, match="4 heads but key/value have 2; pass enable_gqa"):
            F.scaled_dot_product_attention(lq, lk2, lv2)
        out = F.scaled_dot_product_attention(lq, lk1, lv1, is_causal=True)  # Falcon's MQA
        assert_close(cp.unshard([out], [2])[0], full_mqa, atol=1e-12, rtol=1e-12, what="mqa")
        mha = nn.MultiheadAttention(16, 4, batch_first=True, dtype=torch.float64)
        x = lq.transpose(1, 2).reshape(1, 8, 32)[..., :16].contiguous()
        with pytest.raises(NotImplementedError, match="need_weights=False"):
            mha(x, x, x)
        calls = len(CALLS)
        mha(x, x, x, need_weights=False)
        assert len(CALLS) == calls + 1 and CALLS[-1]["shape"] == (1, 4, 8, 4)
    # After the context SDPA is plain again and the buffers are whole.
    assert bufs[0].shape == q.shape and torch.equal(bufs[0], q)
    calls = len(CALLS)
    assert torch.equal(sdpa_ref(q, k, v, is_causal=True), full)
    assert len(CALLS) == calls
    del rank


@pytest.mark.parametrize("redispatch", [True, False])
def test_dispatch_paths(ranks, redispatch):
    ranks(2).run(_check_dispatch_paths, redispatch)


def _check_style_needs_dispatcher() -> str:
    use_ring("reference")
    _reset_options()
    mesh = _mesh()
    attn = parallelize_module(_Attention(False), mesh, _ContextParallel(
        seq_dim=2, attention_type=_ContextParallel.AttentionType.SDPA))
    q = torch.rand(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="_enable_context_parallel_dispatcher") as info:
        attn(q, q, q)
    with pytest.raises(NotImplementedError, match="seq_dim=1"):
        _ContextParallel(seq_dim=1, attention_type=_ContextParallel.AttentionType.SDPA)._apply(
            _Attention(False), mesh)
    return str(info.value)


def test_style_requires_enabled_dispatcher(ranks):
    ranks(2).run(_check_style_needs_dispatcher)


def _check_flex_style() -> None:
    """The flex style takes over the module's flex calls, not its forward: a
    forward that calls no flex_attention sees its own shards, whatever the
    rotation (the all-gather of K/V happens inside a flex call only)."""
    mesh, n, rank = _mesh(), dist.get_world_size(), dist.get_rank()

    class Probe(nn.Module):
        def forward(self, query, key, value):
            return key, value

    probe = parallelize_module(Probe(), mesh, _ContextParallel(
        seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX))
    k_full = _rand((1, 2, 4 * n, 8), 5)
    v_full = _rand((1, 1, 4 * n, 8), 6)
    k, v = k_full.chunk(n, 2)[rank], v_full.chunk(n, 2)[rank]
    before = cplib._cp_options.rotate_method
    try:
        for rotation in ("allgather", "p2p"):
            cplib.set_rotate_method(rotation)
            gk, gv = probe(k, k, value=v)
            assert torch.equal(gk, k) and torch.equal(gv, v), rotation
    finally:
        cplib._cp_options.rotate_method = before


def test_flex_style_keeps_a_forward_without_flex_calls(ranks):
    ranks(2).run(_check_flex_style)


def test_sdpa_kernel_selects_the_ring_backend():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from cplib.frontend.sdpa_dispatch import sdpa_backend_hint

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert sdpa_backend_hint(cpu) is None and sdpa_backend_hint(cuda) is None
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        assert sdpa_backend_hint(cuda) == "cudnn" and sdpa_backend_hint(cpu) is None
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION],
                     set_priority=True):
        assert sdpa_backend_hint(cuda) == "cudnn"
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION],
                     set_priority=True):
        assert sdpa_backend_hint(cuda) == "efficient"
    with sdpa_kernel(SDPBackend.MATH):
        with pytest.raises(NotImplementedError, match="enabled none of them"):
            sdpa_backend_hint(cuda)
