"""context_parallel's buffers: restored after an exception (shape, strides,
bytes; those in no_restore_buffers left sharded), shard/unshard round trips
with and without load balancers (values and the differentiable unshard's
gradient), and bad input raising the same ValueError on every rank before
anything is sharded. Run against ``cp_reference`` (an all-gather stand-in
for the ring op)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import cplib
from cp_reference import CALLS, use_ring
from cplib import (
    _cp_options,
    _HeadTailLoadBalancer,
    _PerDocumentHeadTailLoadBalancer,
    _RotateMethod,
    context_parallel,
    context_parallel_unshard,
)


def _mesh() -> DeviceMesh:
    return DeviceMesh("cpu", list(range(dist.get_world_size())))


def _rand(shape, seed, dtype=torch.float32):
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _reset_options() -> None:
    # Rank processes outlive a test: every check starts from the defaults.
    _cp_options.enable_load_balance = True
    _cp_options.rotate_method = _RotateMethod.P2P


def _check_restore_after_exception() -> None:
    use_ring("reference")
    _reset_options()
    mesh, n, rank = _mesh(), dist.get_world_size(), dist.get_rank()
    ids = torch.arange(64).view(2, 32).clone()
    pos = torch.arange(32).expand(2, 32)  # stride-0 batch, as models build positions
    feats = _rand((32, 2, 3), 4).transpose(0, 1)  # non-contiguous, seq on dim 1
    dropped = torch.arange(32.0)
    bufs = [ids, pos, feats, dropped]
    before = [(b.shape, b.stride(), b.storage_offset(), b.clone()) for b in bufs]
    with pytest.raises(KeyError, match="boom"):
        with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[1, 1, 1, 0],
                              no_restore_buffers={dropped}):
            chunks = [list(range(8 * c, 8 * c + 8)) for c in (rank, 2 * n - 1 - rank)] \
                if n == 2 else None
            assert ids.shape == (2, 32 // n) and pos.shape == (2, 32 // n)
            if chunks is not None:
                assert pos[0].tolist() == chunks[0] + chunks[1]
                assert ids[1].tolist() == [32 + i for i in chunks[0] + chunks[1]]
            ids.add_(1000)  # in-place edits inside the context are discarded too
            raise KeyError("boom")
    for b, (shape, stride, offset, values) in zip(bufs[:3], before[:3]):
        assert b.shape == shape and b.stride() == stride and b.storage_offset() == offset
        raw = b.contiguous().view(-1).view(torch.uint8)
        assert torch.equal(raw, values.contiguous().view(-1).view(torch.uint8))
    assert torch.equal(pos, torch.arange(32).expand(2, 32)) and pos.stride() == (0, 1)
    assert dropped.shape == (32 // n,)  # not restored, as asked
    # SDPA is plain again after the exception.
    calls = len(CALLS)
    q = _rand((1, 1, 8, 4), 9)
    F.scaled_dot_product_attention(q, q, q)
    assert len(CALLS) == calls


def test_buffers_restored_after_exception(ranks):
    ranks(2).run(_check_restore_after_exception)


def _check_round_trips(seed: int) -> int:
    _reset_options()
    mesh, n = _mesh(), dist.get_world_size()
    rng = random.Random(seed)  # same cases on every rank
    checked = 0
    for _ in range(25):
        ndim = rng.randint(1, 4)
        seq_dim = rng.randint(-ndim, ndim - 1)
        kind = rng.choice(["none", "head_tail", "per_doc"])
        unit = 2 * n if kind != "none" else n
        shape = [rng.randint(1, 3) for _ in range(ndim)]
        shape[seq_dim] = unit * rng.randint(1, 4)
        x = torch.randn(shape, generator=torch.Generator().manual_seed(rng.randint(0, 999)))
        seq = shape[seq_dim]
        lb = None
        if kind == "head_tail":
            lb = _HeadTailLoadBalancer(seq, n, "cpu")
        elif kind == "per_doc" and seq_dim % ndim > 0:
            docs = [unit] * (seq // unit)
            lb = _PerDocumentHeadTailLoadBalancer([docs] * shape[0], n, "cpu")
        (local,) = cplib.shard(mesh, [x], [seq_dim], lb)
        assert local.shape[seq_dim] == seq // n
        # torch's unshard reads the global option when no balancer is given.
        _cp_options.enable_load_balance = lb is not None
        (back,) = context_parallel_unshard(mesh, [local], [seq_dim], lb)
        assert torch.equal(back, x)
        # The differentiable unshard: same values, each rank gets its slice back.
        leaf = local.clone().requires_grad_(True)
        (full,) = cplib.unshard(mesh, [leaf], [seq_dim], lb)
        assert torch.equal(full.detach(), x)
        g = torch.randn(shape, generator=torch.Generator().manual_seed(checked))
        full.backward(g)
        assert torch.equal(leaf.grad, cplib.shard(mesh, [g], [seq_dim], lb)[0])
        checked += 1
    return checked


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_shard_unshard_round_trip(ranks, world_size):
    assert ranks(world_size).run(_check_round_trips, world_size) == [25] * world_size


def _expect(exc, fn, match):
    with pytest.raises(exc, match=match) as info:
        fn()
    return str(info.value)


def _check_bad_inputs() -> list[str]:
    _reset_options()
    mesh, n = _mesh(), dist.get_world_size()
    s = 2 * n * 4 + n  # divisible by n, not by 2n
    x = torch.zeros(1, 2, s, 4)
    y = torch.zeros(1, 2, 8 * n, 4)

    def enter(**kw):
        with context_parallel(mesh, **kw):
            raise AssertionError("the context must not be entered")

    msgs = [
        _expect(ValueError, lambda: enter(buffers=[x, y], buffer_seq_dims=[2, 2],
                                          load_balance=True),
                rf"needs every buffer's sequence length to be the same; "
                rf"got lengths \[{s}, {8 * n}\]"),
        _expect(ValueError, lambda: enter(buffers=[y.clone().requires_grad_(True)],
                                          buffer_seq_dims=[2]), r"buffer 0 .* requires grad"),
        _expect(ValueError, lambda: enter(buffers=[y, x], buffer_seq_dims=[2]),
                "buffer_seq_dims has 1 entries but there are 2 buffers"),
        _expect(ValueError, lambda: enter(buffers=[y, x]),
                "buffer_seq_dims is None but there are 2 buffers"),
        _expect(ValueError, lambda: enter(buffers=[y], buffer_seq_dims=[2],
                                          no_restore_buffers={x}),
                r"subset of buffers; a tensor of shape \(1, 2, %d, 4\)" % s),
        _expect(ValueError, lambda: enter(buffers=[torch.zeros(3, n - 1)],
                                          buffer_seq_dims=[1]),
                f"length {n - 1} .* shorter than the context-parallel world size {n}"),
        _expect(ValueError, lambda: enter(buffers=[y], buffer_seq_dims=[4]),
                "seq_dim 4 is out of range"),
        _expect(NotImplementedError, lambda: enter(rotate_method="ring"), "'ring'"),
    ]
    # A nested context given a buffer that the enclosing one holds sharded
    # would shard the shard (before, silently: attention over a quarter of
    # the sequence at N=2); one given other buffers enters.
    z = torch.arange(8 * n).view(1, 8 * n)
    with context_parallel(mesh, buffers=[y, z], buffer_seq_dims=[2, 1]):
        msgs.append(_expect(ValueError, lambda: enter(buffers=[x, z], buffer_seq_dims=[2, 1]),
                            r"buffer 1 \(shape \(1, 8\)\) is already sharded by an enclosing "
                            "context_parallel"))
        assert z.shape == (1, 8)
        # (of the same layout: a nested region of another is refused,
        # tests/frontend/test_cp_entry.py)
        w = torch.zeros(1, 2, 8 * n, 4)
        with context_parallel(mesh, buffers=[w], buffer_seq_dims=[2]):
            assert w.shape[2] == 8
    assert z.shape == (1, 8 * n) and torch.equal(z[0], torch.arange(8 * n)) and w.shape[2] == 8 * n
    mesh2d = init_device_mesh("cpu", (1, n), mesh_dim_names=("dp", "cp"))
    msgs.append(_expect(ValueError, lambda: _enter2d(mesh2d, y), r'1-D device mesh.*mesh\["cp"\]'))
    # Nothing was sharded and the group still works.
    assert y.shape == (1, 2, 8 * n, 4) and x.shape == (1, 2, s, 4)
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == n
    # Without an explicit request, an indivisible length falls back to
    # sequential sharding (torch's behaviour).
    rank = dist.get_rank()
    ids = torch.arange(s).view(1, s)
    with context_parallel(mesh, buffers=[ids], buffer_seq_dims=[1]) as cp:
        assert not cp.config.load_balanced
        assert ids[0].tolist() == list(range(rank * s // n, (rank + 1) * s // n))
    # Asked for, head-tail balancing takes any length (chunks within one token).
    from cplib.attention.layout import shard_positions
    with context_parallel(mesh, buffers=[ids], buffer_seq_dims=[1], load_balance=True) as cp:
        assert cp.config.load_balanced
        assert ids[0].tolist() == shard_positions(s, n, rank, True).tolist()
    return msgs


def _enter2d(mesh2d, y):
    with context_parallel(mesh2d, buffers=[y], buffer_seq_dims=[2]):
        raise AssertionError("the context must not be entered")


@pytest.mark.parametrize("world_size", [2, 4])
def test_bad_input_value_errors_on_every_rank(ranks, world_size):
    msgs = ranks(world_size).run(_check_bad_inputs)
    assert len(msgs) == world_size and all(len(m) == 10 for m in msgs)
    assert all(m == msgs[0] for m in msgs)
