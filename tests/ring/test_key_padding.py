"""Key-padding masks (boolean or additive, broadcastable to (B, 1, 1, S_k))
under context parallelism, op by op, against an fp64 reference on the full
sequence: ring_sdpa with every rotation (with causal, load balancing,
documents and windows), Ulysses and USP, ranks of different local lengths
(non-causal), and masks of any other shape, or that require grad, raising
NotImplementedError."""

from __future__ import annotations

import unittest.mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import cplib
from cplib.attention import key_padding
from cplib.attention.layout import shard_positions
from cplib.ulysses.usp_layout import usp_groups
from harness import assert_close
from ring_cases import global_tensor
from ring_mask_cases import visible

B, HQ, HKV, D = 2, 4, 2, 8
TOL = 1e-10  # fp64 throughout


def _key_mask(kind: str, s: int, seed: int) -> torch.Tensor:
    """(B, S): padding at some odd positions only, so that every query of
    every case (causal, windows of left >= 1, documents of even bounds) still
    sees a key. Boolean (True = attend) or additive (-inf where padded)."""
    g = torch.Generator().manual_seed(seed)
    padded = (torch.rand(B, s, generator=g) < 0.5) & (torch.arange(s) % 2 == 1)
    if kind == "bool":
        return ~padded
    bias = -3 * torch.rand(B, s, generator=g, dtype=torch.float64)
    return bias.masked_fill(padded, float("-inf"))


def _reference(q, k, v, cot, allowed: torch.Tensor, key_mask: torch.Tensor):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    kx, vx = (t.repeat_interleave(HQ // HKV, 1) for t in (k, v))
    scores = q @ kx.transpose(-1, -2) * D ** -0.5
    if key_mask.dtype == torch.bool:
        scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    else:
        scores = scores + key_mask[:, None, None, :]
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    out = torch.softmax(scores, -1) @ vx
    out.backward(cot)
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def _case(fn, s: int, positions: torch.Tensor, kind: str, seed: int, what: str, *,
          causal=False, cu_seqlens=None, window=None, **kwargs) -> None:
    q, k, v, cot = (global_tensor((B, h, s, D), torch.float64, seed + i)
                    for i, h in enumerate((HQ, HKV, HKV, HQ)))
    key_mask = _key_mask(kind, s, seed)
    allowed = visible(s, causal=causal, cu_seqlens=cu_seqlens, window=window)
    want = _reference(q, k, v, cot, allowed, key_mask)
    lq, lk, lv = (t[:, :, positions].clone().requires_grad_(True) for t in (q, k, v))
    local_mask = key_mask[:, positions].view(B, 1, 1, -1)
    if cu_seqlens is not None:
        kwargs["cu_seqlens"] = torch.tensor(cu_seqlens)
    if window is not None:
        kwargs["window"] = window
    out, lse = fn(lq, lk, lv, is_causal=causal, attn_mask=local_mask, **kwargs)
    out.backward(cot[:, :, positions])
    for label, got, ref in zip(("out", "lse", "dq", "dk", "dv"),
                               (out, lse, lq.grad, lk.grad, lv.grad), want):
        ref = ref[:, :, positions]
        assert_close(got, ref, atol=TOL, rtol=TOL, what=f"{label} [{what} mask={kind}]")


def _check_ring() -> int:
    rank, n = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    checks = 0
    for rotate in ("p2p", "alltoall", "allgather"):
        def ring(*a, **kw):
            return cplib.ring_sdpa(*a, group, rotate=rotate, **kw)

        s = 8 * n
        what = f"ring {rotate} N={n}"
        seq = shard_positions(s, n, rank, False)
        ht = shard_positions(s, n, rank, True)
        _case(ring, s, seq, "bool", 1, f"{what} dense")
        _case(ring, s, ht, "additive", 2, f"{what} causal lb", causal=True, load_balanced=True)
        docs = [0, 4, 10, s]
        _case(ring, s, seq, "bool", 3, f"{what} documents", causal=True, cu_seqlens=docs,
              seq_len=s)
        _case(ring, s, ht, "additive", 4, f"{what} window lb", causal=True, window=(3, 0),
              load_balanced=True, seq_len=s)
        _case(ring, s, seq, "bool", 5, f"{what} window both sides", window=(2, 3), seq_len=s)
        # Ranks of different lengths, learned by the op (non-causal, no seq_len).
        uneven = s + 1
        _case(ring, uneven, shard_positions(uneven, n, rank, False), "additive", 6,
              f"{what} uneven lengths")
        checks += 6
    return checks


def _check_cuda_bias_columns() -> list[int]:
    """The CUDA route's wider bias tail (head dims padded to a multiple of 8)
    on the CPU: bias_columns answers as for CUDA tensors, so q and k carry
    the bias in one column and zeros in the rest, as they do on a GPU."""
    rank, n = dist.get_rank(), dist.get_world_size()
    s = 8 * n
    cuda_rule = key_padding.bias_columns

    def ring(*a, **kw):
        return cplib.ring_sdpa(*a, dist.group.WORLD, **kw)

    used = []

    def as_on_cuda(head_dim: int, _device_type: str) -> int:
        used.append(cuda_rule(head_dim, "cuda"))
        return used[-1]

    with unittest.mock.patch.object(key_padding, "bias_columns", as_on_cuda):
        _case(ring, s, shard_positions(s, n, rank, True), "additive", 7,
              f"ring N={n}, CUDA's bias columns", causal=True, load_balanced=True)
    return sorted(set(used))


def _check_ulysses_usp() -> int:
    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = DeviceMesh("cpu", list(range(n)))
    checks = 0
    for u in sorted({2, n}):
        groups = usp_groups(mesh.get_group(), u)
        for lb in (False, True):
            s = 8 * n
            positions = torch.arange(s).view(1, 1, s, 1)
            balancer = cplib.usp_load_balancer(s, n, u) if lb else None
            positions = cplib.shard(mesh, [positions], [2], balancer)[0].flatten()
            if groups.ring_group is None:
                def fn(*a, load_balanced=False, **kw):
                    return cplib.ulysses_sdpa(*a, groups.ulysses_group, **kw)
            else:
                def fn(*a, **kw):
                    return cplib.usp_sdpa(*a, groups.ulysses_group, groups.ring_group, **kw)
            what = f"usp u={u} N={n} lb={lb}"
            _case(fn, s, positions, "bool", 10 + lb, f"{what} dense", load_balanced=lb)
            _case(fn, s, positions, "additive", 12 + lb, f"{what} causal", causal=True,
                  load_balanced=lb)
            checks += 2
        # Ranks of different lengths (non-causal), learned by the exchange.
        s = 8 * n + 1
        _case(fn if groups.ring_group is not None else
              (lambda *a, **kw: cplib.ulysses_sdpa(*a, groups.ulysses_group, **kw)),
              s, shard_positions(s, n, rank, False), "bool", 14, f"usp u={u} uneven")
        checks += 1
    return checks


def _check_bad_masks() -> int:
    g = dist.group.WORLD
    q = torch.randn(B, HQ, 4, D)
    k = v = torch.randn(B, HKV, 4, D)
    bad = [torch.ones(4, 4, dtype=torch.bool), torch.ones(B, HQ, 1, 4, dtype=torch.bool),
           torch.ones(B, 1, 1, 5, dtype=torch.bool), torch.ones(3, 1, 1, 4, dtype=torch.bool)]
    for mask in bad:
        for fn in (lambda m: cplib.ring_sdpa(q, k, v, g, attn_mask=m),
                   lambda m: cplib.ulysses_sdpa(q, k, v, g, attn_mask=m)):
            shape = str(tuple(mask.shape)).replace("(", r"\(").replace(")", r"\)")
            with pytest.raises(NotImplementedError, match=f"attn_mask \\(got {shape}\\)"):
                fn(mask)
    with pytest.raises(ValueError, match="boolean or floating point, got torch.int64"):
        cplib.ring_sdpa(q, k, v, g, attn_mask=torch.ones(B, 1, 1, 4, dtype=torch.long))
    # An additive mask that requires grad would get none (the bias enters as a
    # constant): before, its gradient was silently missing.
    bias = torch.zeros(1, 1, 1, 4, requires_grad=True)
    for fn in (lambda: cplib.ring_sdpa(q, k, v, g, attn_mask=bias),
               lambda: cplib.ulysses_sdpa(q, k, v, g, attn_mask=bias)):
        with pytest.raises(NotImplementedError, match="attn_mask requires grad"):
            fn()
    x = torch.randn(B, HQ, 4 * dist.get_world_size(), D)
    with cplib.context_parallel(DeviceMesh("cpu", list(range(dist.get_world_size()))),
                                buffers=[x], buffer_seq_dims=[2]):
        with pytest.raises(NotImplementedError, match="attn_mask requires grad"):
            torch.nn.functional.scaled_dot_product_attention(x, x, x, attn_mask=bias * 2)
    return len(bad)


def test_key_padding_ring_every_rotation(ranks):
    assert ranks(2).run(_check_ring) == [18, 18]


def test_bias_columns_pad_cuda_head_dims_to_multiples_of_8():
    assert [key_padding.bias_columns(d, "cuda") for d in (8, 36, 63, 64, 72)] == [8, 4, 1, 8, 8]
    assert {key_padding.bias_columns(d, dev) for d in (8, 36) for dev in ("cpu", "meta")} == {1}


def test_key_padding_with_cuda_bias_columns(ranks):
    assert ranks(2).run(_check_cuda_bias_columns) == [[8], [8]]  # D = 8: eight more


@pytest.mark.parametrize("world_size", [2, 4])
def test_key_padding_ulysses_and_usp(ranks, world_size):
    want = 5 * len({2, world_size})
    assert ranks(world_size).run(_check_ulysses_usp) == [want] * world_size


def test_other_mask_shapes_raise(ranks):
    assert ranks(2).run(_check_bad_masks) == [4, 4]
