"""``tp_convolution`` on CUDA tensors (GPU; CPLIB_GPU_TESTS_ON_CPU=1 runs the
same bodies on the CPU), through ``cplib.tp_conv``, so the op's CUDA kernel
and the halo pack/unpack CUDA kernels: 2 and 4 threaded ranks sharing one
GPU, bf16 and fp16, against fp64 truth: at most 1.5x the error of the same
computation on one device. The gradients a rank returns for a replicated
input (conv weight and bias) are its partial sums: judged per rank against
the fp64 partial sums, as are the single device's."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import cplib
from gpu_cases import DEVICE, GPU_MARKS, HALF_DTYPES, global_input, rel_err, ranks, sync

pytestmark = GPU_MARKS
CONV = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}
# (x shape with the shard dim's size per rank, shard dim, weight shape, conv keywords)
CONV_CASES = {
    "2d": ((2, 8, 12, 10), -1, (8, 8, 3, 3), dict(padding=1)),
    "2d-dil2-dim2": ((2, 8, 9, 12), 2, (6, 8, 3, 3), dict(padding=2, dilation=2)),
    "2d-depthwise-k7": ((1, 8, 11, 14), -1, (8, 1, 7, 7), dict(padding=3, groups=8)),
    "3d": ((1, 4, 6, 5, 8), -1, (4, 4, 3, 3, 3), dict(padding=1)),
    "1d-k5": ((2, 6, 40), -1, (6, 6, 5), dict(padding=2)),
}


def _conv_rank(x_full, w, b, cot_parts, dim, kw) -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    x = x_full.chunk(n, dim)[rank].to(DEVICE).requires_grad_(True)
    wl, bl = (t.to(DEVICE, copy=True).requires_grad_(True) for t in (w, b))
    out = cplib.tp_conv(x, wl, bl, dim=dim, group=dist.group.WORLD, **kw)
    out.backward(cot_parts[rank].to(DEVICE))
    sync()
    return dict(out=out.detach().cpu(), dx=x.grad.cpu(), dw=wl.grad.cpu(), db=bl.grad.cpu())


def _full_conv(x, w, b, cot_parts, dim, kw, dev):
    """Output, grad_input, and per output slice the weight and bias gradients."""
    x, w, b = (t.to(dev, copy=True).requires_grad_(True) for t in (x, w, b))
    out = CONV[x.dim()](x, w, b, **kw)
    grads = []
    for part in range(len(cot_parts)):
        cot = torch.cat([c.to(dev) if i == part else torch.zeros_like(c, device=dev)
                         for i, c in enumerate(cot_parts)], dim)
        grads.append(torch.autograd.grad(out, (w, b), cot, retain_graph=True))
    dx = torch.autograd.grad(out, x, torch.cat([c.to(dev) for c in cot_parts], dim))[0]
    return (out.detach().cpu(), dx.cpu(), torch.stack([g[0].cpu() for g in grads]),
            torch.stack([g[1].cpu() for g in grads]))


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(CONV_CASES))
def test_tp_conv_on_gpu(name, world_size, dtype):
    n, failures = world_size, []
    i = list(CONV_CASES).index(name)  # seeds
    local, dim, w_shape, kw = CONV_CASES[name]
    dim_ = dim % len(local)
    full = list(local)
    full[dim_] *= n
    x = global_input(full, dtype, 10 * i)
    w = global_input(w_shape, dtype, 10 * i + 1) * (w_shape[1] * w_shape[2]) ** -0.5
    b = global_input((w_shape[0],), dtype, 10 * i + 2)
    out64 = CONV[len(full)](x.double(), w.double(), b.double(), **kw)
    # "same" convolutions: rank r's output columns are its input columns
    cot_parts = [global_input(c.shape, dtype, 10 * i + 3 + j)
                 for j, c in enumerate(out64.chunk(n, dim_))]
    want = _full_conv(x.double(), w.double(), b.double(), [c.double() for c in cot_parts],
                      dim_, kw, "cpu")
    single = _full_conv(x, w, b, cot_parts, dim_, kw, DEVICE)
    per_rank = ranks(n, _conv_rank, x, w, b, cot_parts, dim, kw)
    got = (torch.cat([r["out"] for r in per_rank], dim_),
           torch.cat([r["dx"] for r in per_rank], dim_),
           torch.stack([r["dw"] for r in per_rank]), torch.stack([r["db"] for r in per_rank]))
    for what, g, s, wt in zip(("out", "grad_input", "grad_weight", "grad_bias"), got,
                              single, want):
        err, ref = rel_err(g, wt), rel_err(s, wt)
        if not err <= 1.5 * ref:
            failures.append(f"{dtype} n={n} {name} {what}: error {err:.3e} > 1.5 x "
                            f"single-device {ref:.3e}")
    assert not failures, "\n".join(failures)
