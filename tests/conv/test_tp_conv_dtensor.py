"""nn.Conv1d/2d/3d modules on DTensor inputs routed to cplib_c::tp_convolution
(``cplib.enable_dtensor_conv``), including the upstream prototype's own checks
(downsampling Conv2d k=4 s=4 and depthwise Conv2d k=7 p=3, 10 SGD steps),
against the same module trained on the full input in one process."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor

import cplib
from harness import assert_close

TOL = {torch.float64: dict(atol=1e-10, rtol=1e-10), torch.float32: dict(atol=1e-5, rtol=1e-5)}


def _rand(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=g, dtype=torch.float64).to(dtype)


def _train_and_compare(module: nn.Module, x_shape, shard_dim: int, steps: int, dtype,
                       x_grad: bool, what: str, mesh_shape=None, placements=None) -> float:
    """``steps`` SGD steps on the DTensor module and on a copy with full
    inputs; compares outputs and input grads each step and parameters at the
    end. Returns the weight MSE (the upstream test's metric)."""
    n = dist.get_world_size()
    mesh = init_device_mesh("cpu", mesh_shape or (n,))
    placements = placements or [Shard(shard_dim)]
    module = module.to(dtype)
    ref = copy.deepcopy(module)
    dmodule = distribute_module(module, mesh)  # parameters replicated
    opt = torch.optim.SGD(dmodule.parameters(), lr=1e-3)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=1e-3)
    tol = TOL[dtype]
    for step in range(steps):
        x_full = _rand(x_shape, dtype, 100 + step)
        x = distribute_tensor(x_full, mesh, placements)
        xr = x_full.clone()
        if x_grad:
            x = x.detach().requires_grad_(True)
            xr.requires_grad_(True)
        out, out_ref = dmodule(x), ref(xr)
        assert isinstance(out, DTensor) and out.placements == tuple(placements)
        assert_close(out.full_tensor(), out_ref.detach(), what=f"{what} out step {step}", **tol)
        cot = _rand(out_ref.shape, dtype, 200 + step) * 1e-3
        out.backward(distribute_tensor(cot, mesh, placements))
        out_ref.backward(cot)
        if x_grad:
            assert_close(x.grad.full_tensor(), xr.grad, what=f"{what} grad_input step {step}",
                         **tol)
        for (name, p), pr in zip(dmodule.named_parameters(), ref.parameters()):
            assert all(isinstance(q, Replicate) for q in p.grad.placements), \
                f"{name} grad {p.grad.placements}"
            assert_close(p.grad.to_local(), pr.grad, what=f"{what} grad {name} step {step}", **tol)
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
    for (name, p), pr in zip(dmodule.named_parameters(), ref.parameters()):
        assert_close(p.to_local(), pr.detach(), what=f"{what} final {name}", **tol)
    diff = dmodule.weight.to_local() - ref.weight.detach()
    return float((diff * diff).mean())


def _check_seed_tests() -> list[float]:
    cplib.enable_dtensor_conv()
    try:
        torch.manual_seed(0)
        # Upstream: rand(7,3,512,1024), Conv2d(3,256,k=4,s=4); reduced for CPU time.
        mse_down = _train_and_compare(nn.Conv2d(3, 64, kernel_size=4, stride=4), (7, 3, 64, 128),
                                      3, 10, torch.float32, False, "downsampling")
        # Upstream: Conv2d(256,256,k=7,p=3,groups=256) on rand(7,256,512,1024); reduced.
        mse_dw = _train_and_compare(nn.Conv2d(16, 16, kernel_size=7, padding=3, groups=16),
                                    (2, 16, 32, 64), 3, 10, torch.float32, False, "depthwise")
    finally:
        cplib.disable_dtensor_conv()
    assert mse_down <= 1e-6 and mse_dw <= 1e-6, (mse_down, mse_dw)
    return [mse_down, mse_dw]


@pytest.mark.parametrize("world_size", [2, 4])
def test_upstream_seed_checks(ranks, world_size):
    ranks(world_size).run(_check_seed_tests)


def _check_modules() -> None:
    cplib.enable_dtensor_conv()
    try:
        torch.manual_seed(1)
        f64 = torch.float64
        n = dist.get_world_size()
        _train_and_compare(nn.Conv1d(3, 4, 3, padding=1), (2, 3, 6 * n), 2, 2, f64, True,
                           "conv1d")
        _train_and_compare(nn.Conv2d(3, 4, 3, padding=1), (2, 3, 5, 4 * n), 3, 2, f64, True,
                           "conv2d last")
        _train_and_compare(nn.Conv2d(3, 4, 5, padding=4, dilation=2, bias=False),
                           (1, 3, 4 * n, 5), 2, 2, f64, True, "conv2d dim2 dilated no bias")
        _train_and_compare(nn.Conv2d(4, 4, 3, padding=1, groups=2), (2, 4, 4, 5 * n), 3, 2, f64,
                           False, "conv2d groups, input without grad")
        _train_and_compare(nn.Conv3d(2, 3, 3, padding=1), (1, 2, 3, 4 * n, 3), 3, 2, f64, True,
                           "conv3d dim3")
        # Batch sharding needs no exchange, whatever the parameters (torch #176446).
        _train_and_compare(nn.Conv2d(3, 4, 3, stride=2, padding=2, dilation=2), (2 * n, 3, 7, 9),
                           0, 2, f64, True, "batch shard")
        if n == 4:  # 2-D mesh: batch on one mesh dim, width on the other (either order)
            _train_and_compare(nn.Conv2d(3, 4, 3, padding=1), (4, 3, 5, 8), 3, 2, f64, True,
                               "2-D mesh batch x width", (2, 2), [Shard(0), Shard(3)])
            _train_and_compare(nn.Conv2d(3, 4, 5, padding=2), (4, 3, 8, 5), 2, 2, f64, True,
                               "2-D mesh height x batch", (2, 2), [Shard(2), Shard(0)])
        if n <= 2:  # a non-"same" conv whose output DTensor's Shard layout matches at n<=2
            _train_and_compare(nn.Conv2d(3, 4, 3), (1, 3, 5, 6 * n), 3, 2, f64, True,
                               "conv2d valid padding")
        else:
            mesh = init_device_mesh("cpu", (n,))
            m = distribute_module(nn.Conv2d(3, 4, 3).double(), mesh)
            x = distribute_tensor(_rand((1, 3, 5, 6 * n), f64, 3), mesh, [Shard(3)])
            with pytest.raises(NotImplementedError, match="same' padding"):
                m(x)
    finally:
        cplib.disable_dtensor_conv()


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_modules_match_full_convolution(ranks, world_size):
    ranks(world_size).run(_check_modules)


def test_enable_disable_restores_torch_handlers():
    from torch.distributed.tensor._tp_conv import convolution_backward_handler, convolution_handler

    handlers = DTensor._op_dispatcher._custom_op_handlers
    aten = torch.ops.aten
    cplib.enable_dtensor_conv()
    cplib.enable_dtensor_conv()  # idempotent
    assert handlers[aten.convolution.default] is not convolution_handler
    cplib.disable_dtensor_conv()
    assert handlers[aten.convolution.default] is convolution_handler
    assert handlers[aten.convolution_backward.default] is convolution_backward_handler
