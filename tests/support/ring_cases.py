"""Shared helpers of the ring_sdpa tests: global inputs, head-tail sharding
and the single-process fp64 reference (out, lse and gradients), and one
checked ring_sdpa case on the current group (ring/test_ring_sdpa.py,
ring/test_ring_sdpa_threaded.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import cplib
from harness import assert_close


def global_tensor(shape, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def shard_seq(t: torch.Tensor, rank: int, n: int, load_balanced: bool) -> torch.Tensor:
    """This rank's slice of dim 2: contiguous, or chunks r and 2N-1-r of 2N."""
    if not load_balanced:
        return t.chunk(n, dim=2)[rank]
    chunks = t.chunk(2 * n, dim=2)
    return torch.cat([chunks[rank], chunks[2 * n - 1 - rank]], dim=2)


def reference(q, k, v, cot, *, is_causal: bool, scale: float | None):
    """fp64 full-sequence SDPA: (out, lse, dq, dk, dv); lse is the logsumexp
    of the scaled, masked scores. The math kernel is named, not chosen by
    SDPA: SDPA's backend flags are global to the process, and a rank thread
    computing this reference must not depend on what another thread set."""
    q, k, v = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    out, _ = torch.ops.aten._scaled_dot_product_attention_math(
        q, k, v, None, 0.0, is_causal, None, scale=scale, enable_gqa=True)
    out.backward(cot.double())
    groups = q.shape[1] // k.shape[1]
    kx = k.detach().repeat_interleave(groups, dim=1)
    s = q.detach() @ kx.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if is_causal:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return out.detach(), lse, q.grad, k.grad, v.grad


def case_tensors(dtype, b: int, hq: int, hkv: int, s: int, d: int, seed: int, *,
                 is_causal: bool, scale: float | None):
    """Global q, k, v and output cotangent of one case, and their fp64
    reference (out, lse, dq, dk, dv)."""
    q = global_tensor((b, hq, s, d), dtype, seed)
    k = global_tensor((b, hkv, s, d), dtype, seed + 1)
    v = global_tensor((b, hkv, s, d), dtype, seed + 2)
    cot = global_tensor((b, hq, s, d), dtype, seed + 3)
    return q, k, v, cot, reference(q, k, v, cot, is_causal=is_causal, scale=scale)


def noncontiguous(t: torch.Tensor) -> torch.Tensor:
    """Same values, storage with the head and sequence dims swapped."""
    out = t.transpose(1, 2).contiguous().transpose(1, 2)
    assert not out.is_contiguous() or out.shape[1] == 1 or out.shape[2] == 1
    return out


def fused_sdpa(q, k, v, *, is_causal: bool, backend: str) -> torch.Tensor:
    """SDPA's output through one named CUDA kernel ("flash", "efficient" or
    "cudnn"), differentiable, k/v heads already matching q's; the kernel is
    named instead of selected with sdpa_kernel, whose flags are global to
    the process (so rank threads may call this)."""
    if backend == "flash":
        return torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, is_causal, False)[0]
    if backend == "efficient":
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, is_causal)[0]
    if backend == "cudnn":
        return torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, is_causal, False)[0]
    raise ValueError(f"unknown backend {backend!r}")


ROTATIONS = ["p2p", "alltoall", "allgather"]
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def _run_case(dtype, is_causal, load_balanced, rotate, hq, hkv, d, b, s_local, noncontig,
              scale=None, seed=0) -> None:
    rank, n = dist.get_rank(), dist.get_world_size()
    s = s_local * n
    q, k, v, cot, ref = case_tensors(dtype, b, hq, hkv, s, d, seed, is_causal=is_causal,
                                     scale=scale)

    def local(t):
        t = shard_seq(t, rank, n, load_balanced)
        return noncontiguous(t) if noncontig else t.clone()

    ql, kl, vl = (local(t).requires_grad_(True) for t in (q, k, v))
    out, lse = cplib.ring_sdpa(ql, kl, vl, dist.group.WORLD, is_causal=is_causal,
                               load_balanced=load_balanced, scale=scale, rotate=rotate)
    out.backward(shard_seq(cot, rank, n, load_balanced))
    what = (f"{dtype} causal={is_causal} lb={load_balanced} {rotate} hq={hq} hkv={hkv} d={d} "
            f"b={b} s_local={s_local} noncontig={noncontig} scale={scale} n={n}")
    assert out.dtype == dtype and out.is_contiguous() and out.shape == ql.shape
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert lse.shape == (b, hq, s_local) and lse.is_contiguous()
    tol = TOL[dtype]
    for name, got, want in (("out", out, ref[0]), ("lse", lse, ref[1]), ("dq", ql.grad, ref[2]),
                            ("dk", kl.grad, ref[3]), ("dv", vl.grad, ref[4])):
        assert_close(got.double(), shard_seq(want, rank, n, load_balanced), atol=tol, rtol=tol,
                     what=f"{name} [{what}]")
