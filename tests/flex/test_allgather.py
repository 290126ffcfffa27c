"""flex_cp_allgather / its reduce-scatter backward against torch.cat of all
shards and the reference gradient, on 1, 2 and 4 gloo ranks."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import cplib
from cplib.comm.native import ops
from harness import assert_close, cplib_import_root

WORLD_SIZES = [1, 2, 4]
DTYPES = [torch.float32, torch.bfloat16, torch.float64]


def _group() -> str:
    return dist.group.WORLD.group_name


def _global(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _check_gather_case(seq_dim: int, dtype: torch.dtype, k_heads: int, v_heads: int,
                       noncontig: bool) -> None:
    rank, n = dist.get_rank(), dist.get_world_size()
    dim = seq_dim % 4
    s_local = 3  # odd on purpose
    def shape(h, d):
        s = [2, h, 5, d]
        s[dim] = s_local * n
        return s
    k_full = _global(shape(k_heads, 8), dtype, 1)
    v_full = _global(shape(v_heads, 6), dtype, 2)
    k = k_full.chunk(n, dim)[rank].clone()
    v = v_full.chunk(n, dim)[rank].clone()
    if noncontig:  # same values, transposed storage
        k = k.transpose(0, 3).contiguous().transpose(0, 3)
        v = v.transpose(0, 3).contiguous().transpose(0, 3)
        assert not k.is_contiguous() or k.numel() <= 1 or k.shape[0] == 1
    k.requires_grad_(True)
    v.requires_grad_(True)
    gk, gv = cplib.flex_cp_allgather(k, v, seq_dim, _group())
    assert gk.is_contiguous() and gv.is_contiguous()
    assert gk.data_ptr() != k.data_ptr()
    assert torch.equal(gk.detach(), k_full) and torch.equal(gv.detach(), v_full)

    # Every rank holds its own cotangent of the full tensor; the reference
    # gradient of a shard is the sum of all ranks' cotangents over that shard.
    cots_k = [_global(gk.shape, dtype, 100 + r) for r in range(n)]
    cots_v = [_global(gv.shape, dtype, 200 + r) for r in range(n)]
    torch.autograd.backward([gk, gv], [cots_k[rank], cots_v[rank]])
    ref_k = sum(c.double() for c in cots_k).chunk(n, dim)[rank]
    ref_v = sum(c.double() for c in cots_v).chunk(n, dim)[rank]
    # The reference sums in fp64; the op sums n values in the input dtype.
    tol = {torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float32: dict(atol=1e-6, rtol=1e-5),
           torch.float64: dict(atol=1e-12, rtol=1e-12)}[dtype]
    assert_close(k.grad.double(), ref_k, what=f"grad k seq_dim={seq_dim}", **tol)
    assert_close(v.grad.double(), ref_v, what=f"grad v seq_dim={seq_dim}", **tol)


def _check_gather_matrix() -> int:
    count = 0
    for seq_dim in (0, 1, 2, 3, -1, -2, -3, -4):
        for dtype in DTYPES:
            for heads in ((4, 4), (4, 2), (1, 3)):
                for noncontig in (False, True):
                    _check_gather_case(seq_dim, dtype, heads[0], heads[1], noncontig)
                    count += 1
    return count


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_allgather_matches_cat_and_reference_grad(ranks, world_size):
    counts = ranks(world_size).run(_check_gather_matrix)
    assert counts == [8 * 3 * 3 * 2] * world_size


def _check_opcheck(requires_grad: bool) -> None:
    n = dist.get_world_size()
    k = torch.randn(2, 4, 3, 8, requires_grad=requires_grad)
    v = torch.randn(2, 2, 3, 8, requires_grad=requires_grad)
    torch.library.opcheck(torch.ops.cplib_c.flex_cp_allgather.default, (k, v, 2, _group()))
    gk = torch.randn(2, 4, 3 * n, 8, requires_grad=requires_grad)
    gv = torch.randn(2, 2, 3 * n, 8, requires_grad=requires_grad)
    torch.library.opcheck(torch.ops.cplib_c.flex_cp_allgather_backward.default,
                          (gk, gv, -2, _group()))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck(ranks, world_size, requires_grad):
    ranks(world_size).run(_check_opcheck, requires_grad)


def _gather_sum(k, v, seq_dim, name):
    gk, gv = cplib.flex_cp_allgather(k * 2, v, seq_dim, name)
    return (gk.sin() * 3).sum(dim=seq_dim), gv + 1


def _check_compiled(backend: str, seq_dim: int) -> None:
    rank = dist.get_rank()
    torch.manual_seed(7 + rank)
    k = torch.randn(2, 4, 6, 8, requires_grad=True)
    v = torch.randn(2, 2, 6, 8, requires_grad=True)
    k2, v2 = (t.detach().clone().requires_grad_(True) for t in (k, v))
    torch._dynamo.reset()
    compiled = torch.compile(_gather_sum, backend=backend, fullgraph=True)
    e1, e2 = _gather_sum(k, v, seq_dim, _group())
    c1, c2 = compiled(k2, v2, seq_dim, _group())
    assert_close(c1, e1, atol=1e-5, rtol=1e-5, what="compiled out 0")
    assert_close(c2, e2, atol=1e-5, rtol=1e-5, what="compiled out 1")
    (e1.sum() + e2.square().sum()).backward()
    (c1.sum() + c2.square().sum()).backward()
    assert_close(k2.grad, k.grad, atol=1e-5, rtol=1e-5, what="compiled grad k")
    assert_close(v2.grad, v.grad, atol=1e-5, rtol=1e-5, what="compiled grad v")


@pytest.mark.parametrize("world_size,backend", [(1, "aot_eager"), (2, "aot_eager"),
                                                (4, "aot_eager"), (2, "inductor")])
def test_compile_fullgraph(ranks, world_size, backend):
    ranks(world_size).run(_check_compiled, backend, 2)


def _expect_value_error(fn, *args, match: str) -> str:
    with pytest.raises(ValueError, match=match) as info:
        fn(*args)
    return str(info.value)


def _check_bad_inputs() -> list[str]:
    k = torch.randn(2, 4, 3, 8)
    msgs = [
        _expect_value_error(cplib.flex_cp_allgather, k, torch.randn(3, 4, 3, 8), 2, _group(),
                            match="differ in dimension 0"),
        _expect_value_error(cplib.flex_cp_allgather, k, torch.randn(2, 4, 5, 8), 2, _group(),
                            match="differ in dimension 2"),
        _expect_value_error(cplib.flex_cp_allgather, k, k, 4, _group(), match="seq_dim=4"),
        _expect_value_error(cplib.flex_cp_allgather, k, k, -5, _group(), match="seq_dim=-5"),
        _expect_value_error(cplib.flex_cp_allgather, k, k, 2, "no-such-group",
                            match="'no-such-group'"),
        _expect_value_error(ops.flex_cp_allgather_backward, k, k, 7, _group(),
                            match="seq_dim=7"),
    ]
    # The group is still healthy: nothing above reached a collective.
    gk, _ = cplib.flex_cp_allgather(k, k, 2, _group())
    assert gk.shape[2] == 3 * dist.get_world_size()
    return msgs


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_bad_input_raises_value_error_on_every_rank(ranks, world_size):
    msgs = ranks(world_size).run(_check_bad_inputs)
    assert len(msgs) == world_size and all(len(m) == 6 for m in msgs)


def _check_threaded() -> None:
    rank, n = dist.get_rank(), dist.get_world_size()
    k = torch.full((1, 2, 2, 4), float(rank))
    gk, gv = cplib.flex_cp_allgather(k, k + 1, 2, _group())
    expect = torch.arange(n, dtype=torch.float32).repeat_interleave(2).view(1, 1, -1, 1)
    assert torch.equal(gk, expect.expand(1, 2, 2 * n, 4))
    dk, _ = torch.ops.cplib_c.flex_cp_allgather_backward(gk, gv, 2, _group())
    assert torch.equal(dk, k * n)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_threaded_process_group(threaded, world_size):
    threaded(world_size, _check_threaded)


def _check_native_gather_on_gloo() -> int:
    from cplib.comm import native as _native
    rank, n = dist.get_rank(), dist.get_world_size()
    name = _group()
    # gloo's own all-gather corrupts the heap with two in flight; on gloo the
    # native layer's gathers are all-to-alls with all_gather's layout.
    assert _native._runs_on_gloo(name, torch.device("cpu"))
    mine = [torch.full((2 + r, 3), float(r)) for r in (rank, rank + 1)]
    a = torch.ops.cplib_c.c10d_all_gather(mine[0][:2], n, name)
    b = torch.ops.cplib_c.c10d_all_gather(mine[1][:2], n, name)  # both in flight
    for out, shift in ((a, 0), (b, 1)):
        torch.ops._c10d_functional.wait_tensor(out)
        want = torch.cat([torch.full((2, 3), float(r + shift)) for r in range(n)])
        assert torch.equal(out, want), (shift, out)
    return 1


@pytest.mark.parametrize("world_size", [2])
def test_native_gather_on_gloo_is_an_all_to_all(ranks, world_size):
    assert ranks(world_size).run(_check_native_gather_on_gloo) == [1] * world_size


@pytest.mark.parametrize("order", ["torch-first", "cplib-first"])
def test_coexists_with_torch_cplib_namespace(order):
    torch_mod = "torch.distributed.tensor.experimental._context_parallel._cp_custom_ops"
    imports = [f"import {torch_mod}", "import cplib"]
    if order == "cplib-first":
        imports.reverse()
    code = "; ".join(imports + [
        "import torch",
        "assert hasattr(torch.ops.cplib_c, 'flex_cp_allgather')",
        "assert hasattr(torch.ops.cplib, 'flex_cp_allgather')",
        "print('ok')",
    ])
    # Run where the cplib under test was imported from (`-c` puts the working
    # folder first on the path).
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=cplib_import_root())
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
