"""ring_sdpa on the threaded process group (all ranks in one process, which is
how several ranks share one GPU): every rotation on CPU here, and the CUDA
matrix (bf16 and fp16; flash, efficient and cuDNN) where a GPU is present."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import cplib
from ring_cases import global_tensor, reference, shard_seq
from test_ring_sdpa import ROTATIONS, _run_case


def _check_threaded_cpu() -> int:
    count = 0
    for i, rotate in enumerate(ROTATIONS):
        _run_case(torch.float64, True, True, rotate, 4, 2, 32, 2, 8, i % 2 == 1, seed=i)
        _run_case(torch.float32, False, False, rotate, 2, 1, 64, 1, 7, False, seed=10 + i)
        count += 2
    return count


@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_sdpa_threaded_group_cpu(threaded, world_size):
    assert threaded(world_size, _check_threaded_cpu) == [6] * world_size


# ---------------------------------------------------------------- CUDA


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    sums = torch.stack([(got.double().cpu() - want).pow(2).sum(), want.pow(2).sum()])
    dist.all_reduce(sums)
    return (sums[0] / sums[1]).sqrt().item()


def _check_cuda(dtype: torch.dtype, backend: str) -> list[str]:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    kernel = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
              "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    rank, n = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", 0)
    report = []
    for causal, lb, rotate, hkv in ((True, True, "p2p", 4), (False, False, "alltoall", 2),
                                    (True, False, "allgather", 1), (False, True, "p2p", 4)):
        b, hq, s, d = 2, 4, 128 * n, 64
        q, k, v, cot = (global_tensor((b, h, s, d), dtype, 20 + i)
                        for i, h in enumerate((hq, hkv, hkv, hq)))
        ref = reference(q, k, v, cot, is_causal=causal, scale=None)
        with sdpa_kernel([kernel]):
            qs, ks, vs = (t.to(dev).requires_grad_(True) for t in (q, k, v))
            kx, vx = (t.repeat_interleave(hq // hkv, dim=1) for t in (ks, vs))
            F.scaled_dot_product_attention(qs, kx, vx, is_causal=causal).backward(cot.to(dev))
            ql, kl, vl = (shard_seq(t, rank, n, lb).to(dev).requires_grad_(True)
                          for t in (q, k, v))
            out, lse = cplib.ring_sdpa(ql, kl, vl, dist.group.WORLD, is_causal=causal,
                                       load_balanced=lb, rotate=rotate, backend=backend)
            out.backward(shard_seq(cot, rank, n, lb).to(dev))
        torch.cuda.synchronize()
        assert torch.allclose(lse.cpu().double(), shard_seq(ref[1], rank, n, lb), atol=2e-2)
        single = [qs.grad.cpu(), ks.grad.cpu(), vs.grad.cpu()]
        for name, got, sgl, want in zip(("out", "dq", "dk", "dv"),
                                        (out, ql.grad, kl.grad, vl.grad),
                                        [None] + single, ref[:1] + ref[2:]):
            ring_err = _rel_err(got, shard_seq(want, rank, n, lb))
            if sgl is None:
                assert ring_err < 2e-2, (name, ring_err)
                continue
            single_err = _rel_err(shard_seq(sgl, rank, n, lb), shard_seq(want, rank, n, lb))
            report.append(f"{dtype} {backend} {name} causal={causal} lb={lb} {rotate}: ring "
                          f"{ring_err:.3e} single {single_err:.3e}")
            assert ring_err <= 1.5 * single_err, report[-1]
    return report


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("backend", ["flash", "efficient", "cudnn"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ring_sdpa_cuda_threaded(threaded, world_size, backend, dtype):
    report = threaded(world_size, _check_cuda, dtype, backend)[0]
    print("\n".join(report))
