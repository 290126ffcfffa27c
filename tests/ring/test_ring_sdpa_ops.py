"""ring_sdpa as an op: opcheck of both ops at world sizes 1 and 2,
torch.compile(fullgraph=True) against eager (aot_eager on every rotation,
inductor on one), and bad input raising ValueError on every rank before any
communication."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import cplib
from cplib.comm.native import ops
from ring_cases import global_tensor, noncontiguous, shard_seq

ROTATIONS = ["p2p", "alltoall", "allgather"]


def _group() -> str:
    return dist.group.WORLD.group_name


def _local_inputs(b, hq, hkv, s_local, d, dtype, lb, seed=0, requires_grad=True):
    rank, n = dist.get_rank(), dist.get_world_size()
    shapes = ((b, hq, s_local * n, d), (b, hkv, s_local * n, d), (b, hkv, s_local * n, d))
    return [shard_seq(global_tensor(s, dtype, seed + i), rank, n, lb).clone()
            .requires_grad_(requires_grad) for i, s in enumerate(shapes)]


# ---------------------------------------------------------------- opcheck


def _check_opcheck() -> int:
    count = 0
    for causal, lb, rotate, heads, noncontig in ((True, True, "p2p", (4, 2), False),
                                                 (False, False, "alltoall", (2, 2), True),
                                                 (True, False, "allgather", (2, 1), False)):
        q, k, v = _local_inputs(2, heads[0], heads[1], 6, 16, torch.float64, lb)
        if noncontig:
            q, k, v = (noncontiguous(t.detach()).requires_grad_(True) for t in (q, k, v))
        args = (_group(), causal, "head_tail" if lb else "sequential", 0.5, "auto", rotate)
        torch.library.opcheck(ops.ring_sdpa.default, (q, k, v, *args))
        with torch.no_grad():
            out, lse = ops.ring_sdpa(q, k, v, *args)
        grad_out = torch.randn_like(out)
        if noncontig:
            grad_out = noncontiguous(grad_out)
        torch.library.opcheck(ops.ring_sdpa_backward.default,
                              (grad_out, q.detach(), k.detach(), v.detach(), out, lse, *args))
        # outputs are fresh, contiguous and never alias the inputs (world size 1 too)
        dq, dk, dv = ops.ring_sdpa_backward(grad_out, q, k, v, out, lse, *args)
        for got, inp in ((out, q), (dq, q), (dk, k), (dv, v)):
            assert got.is_contiguous() and got.shape == inp.shape
            assert got.untyped_storage().data_ptr() != inp.untyped_storage().data_ptr()
        assert dk.untyped_storage().data_ptr() != dv.untyped_storage().data_ptr()
        count += 1
    return count


@pytest.mark.parametrize("world_size", [1, 2])
def test_ring_sdpa_opcheck(ranks, world_size):
    assert ranks(world_size).run(_check_opcheck) == [3] * world_size


# ---------------------------------------------------------------- torch.compile


def _attend(q, k, v, group_name, causal, lb, rotate):
    out, lse = cplib.ring_sdpa(q, k, v, group_name, is_causal=causal, load_balanced=lb,
                               rotate=rotate)
    return out * 2.0, lse


def _check_compile(backends: list[str]) -> int:
    torch._dynamo.reset()
    count = 0
    for backend in backends:
        for rotate in ROTATIONS if backend == "aot_eager" else ["p2p"]:
            causal, lb = rotate != "alltoall", rotate == "p2p"
            compiled = torch.compile(_attend, backend=backend, fullgraph=True)
            results = []
            for fn in (_attend, compiled):
                q, k, v = _local_inputs(1, 4, 2, 8, 16, torch.float32, lb, seed=7)
                out, lse = fn(q, k, v, _group(), causal, lb, rotate)
                assert not lse.requires_grad
                out.backward(torch.ones_like(out))
                results.append((out.detach(), lse, q.grad, k.grad, v.grad))
            for name, e, c in zip(("out", "lse", "dq", "dk", "dv"), *results):
                torch.testing.assert_close(c, e, atol=0, rtol=0,
                                           msg=lambda m: f"{backend} {rotate} {name}: {m}")
            count += 1
    return count


@pytest.mark.parametrize("world_size", [2])
def test_ring_sdpa_compile_aot_eager_and_inductor(ranks, world_size):
    assert ranks(world_size).run(_check_compile, ["aot_eager", "inductor"]) == [4] * world_size


# ---------------------------------------------------------------- bad input


def _expect(exc, match, fn, *args, **kwargs):
    with pytest.raises(exc, match=match):
        fn(*args, **kwargs)


def _check_bad_input() -> int:
    g = _group()
    q, k, v = _local_inputs(1, 4, 2, 6, 8, torch.float32, False, requires_grad=False)
    calls = [
        (ValueError, "rotate='ring'", dict(rotate="ring")),
        (ValueError, "backend='fast'", dict(backend="fast")),
        (ValueError, "backend='efficient' needs CUDA", dict(backend="efficient")),
        (ValueError, "scale=-1", dict(scale=-1.0)),
        (ValueError, "scale=nan", dict(scale=float("nan"))),
    ]
    for exc, match, kwargs in calls:
        _expect(exc, match, cplib.ring_sdpa, q, k, v, g, **kwargs)
    bad_tensors = [
        ("4 heads, which is not a multiple of k/v's 3 heads",
         (q, k.new_zeros(1, 3, 6, 8), v.new_zeros(1, 3, 6, 8)), {}),
        ("expected q, k, v of shape", (q[0], k, v), {}),
        ("one dtype", (q.double(), k, v), {}),
        ("batch sizes differ", (q, k.expand(2, -1, -1, -1), v), {}),
        ("q head dim 8 differs from k head dim 4", (q, k[..., :4], v), {}),
        ("must agree in heads and length", (q, k, v[:, :, :4]), {}),
        ("is_causal needs equal local q and kv lengths, got q 6 and kv 4",
         (q, k[:, :, :4], v[:, :, :4]), dict(is_causal=True)),
        ("unsupported dtype (Long|torch.int64)", (q.long(), k.long(), v.long()), {}),
        ("empty local sequence", (q[:, :, :0], k[:, :, :0], v[:, :, :0]), {}),
    ]
    for match, tensors, kwargs in bad_tensors:
        _expect(ValueError, match, cplib.ring_sdpa, *tensors, g, **kwargs)
    _expect(ValueError, "no process group is registered under the name 'nope'",
            cplib.ring_sdpa, q, k, v, "nope")
    _expect(TypeError, "dropout_p", cplib.ring_sdpa, q, k, v, g, dropout_p=0.1)
    _expect(NotImplementedError, r"key-padding masks.*attn_mask \(got \(6, 6\)\)",
            cplib.ring_sdpa, q, k, v, g, attn_mask=torch.ones(6, 6, dtype=torch.bool))
    # the raw ops check the names of their choices too
    _expect(ValueError, "rotate='ring' is not one of 'p2p', 'alltoall', 'allgather'",
            ops.ring_sdpa, q, k, v, g, rotate="ring")
    _expect(ValueError, "backend='fast' is not one of", ops.ring_sdpa, q, k, v, g, backend="fast")
    _expect(ValueError, "layout='zigzag' is not one of", ops.ring_sdpa, q, k, v, g,
            layout="zigzag")
    _expect(ValueError, "ring_pass='k' is not one of", ops.ring_sdpa, q, k, v, g, ring_pass="k")
    out, lse = ops.ring_sdpa(q, k, v, g)
    _expect(ValueError, "lse must be Float of shape", ops.ring_sdpa_backward, out, q, k, v, out,
            lse.double(), g)
    _expect(ValueError, "grad_out .* must have shape", ops.ring_sdpa_backward, out[:, :1], q, k,
            v, out, lse, g)
    # every rank raised before communicating: the group still works
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size()
    return len(calls) + len(bad_tensors)


@pytest.mark.parametrize("world_size", [2])
def test_ring_sdpa_bad_input(ranks, world_size):
    ranks(world_size).run(_check_bad_input)
