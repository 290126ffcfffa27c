"""``flex_cp_allgather`` on CUDA tensors (GPU; CPLIB_GPU_TESTS_ON_CPU=1 runs
the same bodies on the CPU): the gather and its reduce-scatter backward, 2
and 4 threaded ranks sharing one GPU, bf16 and fp16, against fp64 truth: at
most 1.5x the error of the same computation on one device."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import cplib
from gpu_cases import DEVICE, GPU_MARKS, HALF_DTYPES, global_input, rel_err, ranks, sync

pytestmark = GPU_MARKS


def _gather_rank(k_full, v_full, cots) -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    k, v = (t.chunk(n, 2)[rank].to(DEVICE).requires_grad_(True) for t in (k_full, v_full))
    gk, gv = cplib.flex_cp_allgather(k, v, 2, dist.group.WORLD)
    (gk * cots[0][rank].to(DEVICE)).sum().backward(retain_graph=True)
    (gv * cots[1][rank].to(DEVICE)).sum().backward()
    sync()
    return dict(k=gk.detach().cpu(), v=gv.detach().cpu(), dk=k.grad.cpu(), dv=v.grad.cpu())


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=["bf16", "fp16"])
def test_flex_cp_allgather_on_gpu(world_size, dtype):
    """The gathered K/V are the full K/V bit for bit (GQA: k and v with
    different head counts and head dims); each rank's gradient is the sum of
    every rank's gradient of its shard (a sum reduce-scatter, in the dtype as
    torch's), within 1.5x the error of adding the same tensors one by one in
    the dtype on one device."""
    n, s = world_size, 16 * world_size
    k, v = global_input((2, 2, s, 64), dtype, 1), global_input((2, 4, s, 32), dtype, 2)
    cots = [[global_input(t.shape, dtype, 10 * j + r) for r in range(n)]
            for j, t in enumerate((k, v))]
    per_rank = ranks(n, _gather_rank, k, v, cots)
    failures = []
    for j, (name, full) in enumerate((("k", k), ("v", v))):
        for r in per_rank:
            assert torch.equal(r[name], full), f"gathered {name} differs from the full {name}"
        want = torch.stack([c.double() for c in cots[j]]).sum(0)
        single = cots[j][0].to(DEVICE)  # a reduce-scatter adds in the dtype, one rank at a time
        for c in cots[j][1:]:
            single = single + c.to(DEVICE)
        single = single.cpu()
        got = torch.cat([r["d" + name] for r in per_rank], 2)
        err, ref = rel_err(got, want), rel_err(single, want)
        if not err <= 1.5 * ref:
            failures.append(f"{dtype} n={n} d{name}: error {err:.3e} > 1.5 x single {ref:.3e}")
    assert not failures, "\n".join(failures)
