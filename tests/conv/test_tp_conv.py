"""cplib_c::tp_convolution / tp_convolution_backward against a single-process
convolution of the full input: outputs, grad_input, grad_weight and grad_bias
(after the SUM all-reduce the op documents), on 1, 2 and 4 gloo ranks; opcheck,
torch.compile(fullgraph=True) and bad-input errors on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import cplib
from cplib.conv.tp_conv import _local_out_shape
from harness import assert_close

WORLD_SIZES = [1, 2, 4]
TOL = {torch.float64: dict(atol=1e-10, rtol=1e-10), torch.float32: dict(atol=1e-5, rtol=1e-5)}
CONV = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}

# (name, x shape with the shard dim's size per rank, shard dim, weight shape, kwargs, bias, x grad)
# The shard dim's entry is multiplied by the world size; "+1" cases add one
# column to the full input so that torch.chunk leaves the last rank shorter.
CASES = [
    ("1d k3 p1", (2, 3, 6), -1, (4, 3, 3), dict(padding=1), True, True),
    ("1d k4 p1 even", (2, 3, 5), -1, (4, 3, 4), dict(padding=1), True, True),
    ("1d k2 p0 even", (1, 2, 4), 2, (3, 2, 2), dict(), True, True),
    ("1d k5 p0 valid", (2, 2, 6), -1, (2, 2, 5), dict(), False, True),
    ("2d k3 p1 last", (2, 3, 5, 6), -1, (4, 3, 3, 3), dict(padding=1), True, True),
    ("2d k3 p1 dim2", (2, 3, 6, 5), 2, (4, 3, 3, 3), dict(padding=1), True, True),
    ("2d k4 p2 even overpad", (1, 2, 4, 5), -1, (3, 2, 4, 4), dict(padding=2), True, True),
    ("2d k3 p3 overpad", (1, 2, 4, 5), -1, (3, 2, 3, 3), dict(padding=3), True, True),
    ("2d k1 p0", (2, 3, 4, 3), -1, (5, 3, 1, 1), dict(), True, True),
    ("2d k1 p1", (2, 3, 4, 3), -1, (5, 3, 1, 1), dict(padding=1), True, True),
    ("2d k3 p0 valid", (2, 3, 4, 4), -1, (4, 3, 3, 3), dict(), True, True),
    ("2d k3x5 p(1,2)", (1, 3, 5, 6), -1, (2, 3, 3, 5), dict(padding=(1, 2)), True, True),
    ("2d dil2 k3 p2", (2, 2, 5, 6), -1, (3, 2, 3, 3), dict(padding=2, dilation=2), True, True),
    ("2d dil3 k3 p1", (1, 2, 5, 7), 2, (3, 2, 3, 3), dict(padding=1, dilation=3), True, True),
    ("2d dil2 k4 p3", (1, 2, 4, 7), -1, (2, 2, 4, 4), dict(padding=3, dilation=2), True, True),
    ("2d stride=k=2", (2, 3, 4, 4), -1, (4, 3, 2, 2), dict(stride=2), True, True),
    ("2d stride=k=4", (1, 3, 8, 8), -1, (4, 3, 4, 4), dict(stride=4), True, True),
    ("2d stride=span=3 dil2 k2", (1, 2, 6, 6), -1, (3, 2, 2, 2), dict(stride=3, dilation=2),
     True, True),
    ("2d stride (2,1) shard last", (1, 3, 6, 5), -1, (2, 3, 3, 3), dict(stride=(2, 1), padding=1),
     True, True),
    ("2d groups=2", (2, 4, 4, 5), -1, (6, 2, 3, 3), dict(padding=1, groups=2), True, True),
    ("2d depthwise k7 p3", (1, 4, 5, 7), -1, (4, 1, 7, 7), dict(padding=3, groups=4), True, True),
    ("2d no bias", (2, 3, 4, 5), -1, (4, 3, 3, 3), dict(padding=1), False, True),
    ("2d input without grad", (2, 3, 4, 5), -1, (4, 3, 3, 3), dict(padding=1), True, False),
    ("2d channels_last input", (2, 3, 4, 5), -1, (4, 3, 3, 3), dict(padding=1), True, True),
    ("2d channels_last input dim2", (2, 3, 4, 5), 2, (4, 3, 3, 3), dict(padding=1), True, True),
    ("2d uneven +1", (1, 2, 4, 5), -1, (3, 2, 3, 3), dict(padding=1), True, True),
    ("3d k3 p1 last", (1, 2, 3, 4, 4), -1, (3, 2, 3, 3, 3), dict(padding=1), True, True),
    ("3d k3 p1 dim2", (1, 2, 4, 3, 3), 2, (3, 2, 3, 3, 3), dict(padding=1), True, True),
    ("3d k2 p1 dim3 even", (1, 2, 3, 4, 3), 3, (2, 2, 2, 2, 2), dict(padding=1), True, True),
    ("3d stride=k=2 dim4", (1, 2, 2, 2, 4), 4, (2, 2, 2, 2, 2), dict(stride=2), True, True),
    ("batch shard stride2 p1", (2, 3, 5, 6), 0, (4, 3, 3, 3), dict(stride=2, padding=1),
     True, True),
    ("batch shard dil2 groups", (1, 4, 6, 6), 0, (4, 2, 3, 3), dict(dilation=2, groups=2),
     True, True),
]


def _group() -> str:
    return dist.group.WORLD.group_name


def _rand(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _conv_args(kw: dict, nsp: int) -> tuple[list[int], list[int], list[int], int]:
    def lst(v, default):
        v = kw.get(v, default)
        return list(v) if isinstance(v, tuple) else [v] * nsp
    return lst("stride", 1), lst("padding", 0), lst("dilation", 1), kw.get("groups", 1)


def _check_case(case, dtype) -> None:
    name, local_shape, shard_dim, w_shape, kw, has_bias, x_grad = case
    rank, n = dist.get_rank(), dist.get_world_size()
    dim = shard_dim % len(local_shape)
    full_shape = list(local_shape)
    full_shape[dim] *= n
    if name.endswith("+1") and n > 1:
        full_shape[dim] += 1
    x_full = _rand(full_shape, dtype, 1)
    w_full = _rand(w_shape, dtype, 2)
    b_full = _rand((w_shape[0],), dtype, 3) if has_bias else None

    # Reference: the whole convolution in this process.
    xr = x_full.clone().requires_grad_(x_grad)
    wr = w_full.clone().requires_grad_(True)
    br = b_full.clone().requires_grad_(True) if has_bias else None
    ref = CONV[len(full_shape)](xr, wr, br, **kw)
    cot = _rand(ref.shape, dtype, 4)
    ref.backward(cot)

    # Sharded: this rank's torch.chunk slice.
    widths = [c.shape[dim] for c in x_full.chunk(n, dim)]
    fmt = torch.channels_last if "channels_last" in name else torch.contiguous_format
    x = x_full.chunk(n, dim)[rank].clone(memory_format=fmt).requires_grad_(x_grad)
    w = w_full.clone().requires_grad_(True)
    b = b_full.clone().requires_grad_(True) if has_bias else None
    out = cplib.tp_conv(x, w, b, dim=shard_dim, group=_group(), **kw)

    # Output columns of every rank, as the documented layout assigns them; they
    # must tile the full output exactly.
    stride, padding, dilation, groups = _conv_args(kw, len(full_shape) - 2)
    out_widths = []
    for r in range(n):
        shp = list(full_shape)
        shp[dim] = widths[r]
        out_widths.append(_local_out_shape(shp, w_shape, stride, padding, dilation, groups, dim,
                                           r, n)[dim])
    assert sum(out_widths) == ref.shape[dim], f"{name}: {out_widths} vs {ref.shape[dim]}"
    start = sum(out_widths[:rank])
    assert out.shape[dim] == out_widths[rank], f"{name}: local output shape {tuple(out.shape)}"
    assert out.is_contiguous() and out.data_ptr() != x.data_ptr()
    tol = TOL[dtype]
    assert_close(out, ref.detach().narrow(dim, start, out_widths[rank]), what=f"{name} out", **tol)

    out.backward(cot.narrow(dim, start, out_widths[rank]))
    if x_grad:
        assert_close(x.grad, xr.grad.chunk(n, dim)[rank], what=f"{name} grad_input", **tol)
    else:
        assert x.grad is None
    # grad_weight / grad_bias are partial sums: all-reduce as documented.
    gw = w.grad.clone()
    dist.all_reduce(gw)
    assert_close(gw, wr.grad, what=f"{name} grad_weight", **tol)
    if has_bias:
        gb = b.grad.clone()
        dist.all_reduce(gb)
        assert_close(gb, br.grad, what=f"{name} grad_bias", **tol)


def _check_all_cases(dtype_name: str) -> int:
    dtype = getattr(torch, dtype_name)
    for case in CASES:
        _check_case(case, dtype)
    return len(CASES)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_matches_full_convolution(ranks, world_size, dtype):
    assert ranks(world_size).run(_check_all_cases, dtype) == [len(CASES)] * world_size


def _check_backward_masks() -> None:
    """The backward op alone, each output_mask: undefined grads stay None and
    the defined ones do not depend on the others being computed."""
    rank, n = dist.get_rank(), dist.get_world_size()
    x = _rand((2, 3, 4, 5 * n), torch.float64, 5).chunk(n, -1)[rank].contiguous()
    w = _rand((4, 3, 3, 3), torch.float64, 6)
    go = _rand((2, 4, 4, 5), torch.float64, 7)
    args = (go, x, w, [1], [1], [1], 1, -1, _group())
    full = torch.ops.cplib_c.tp_convolution_backward(*args, [True, True, True])
    for mask in ([True, False, False], [False, True, False], [False, False, True],
                 [False, False, False]):
        got = torch.ops.cplib_c.tp_convolution_backward(*args, mask)
        for m, g, f in zip(mask, got, full):
            if m:
                assert_close(g, f, atol=0, rtol=0, what=f"mask {mask}")
            else:
                assert g is None


@pytest.mark.parametrize("world_size", [2, 4])
def test_backward_output_mask(ranks, world_size):
    ranks(world_size).run(_check_backward_masks)


def _check_opcheck() -> None:
    g = _group()
    for x_shape, w_shape, stride, padding, dilation, groups, dim, bias in [
        ((2, 3, 4, 5), (4, 3, 3, 3), [1], [1], [1], 1, -1, True),
        ((2, 3, 4, 5), (4, 3, 4, 2), [1], [2, 0], [1], 1, 2, False),
        ((1, 4, 6), (4, 1, 3), [1], [2], [2], 4, -1, True),
        ((2, 3, 4, 4), (4, 3, 2, 2), [2], [0], [1], 1, -1, True),
        ((2, 3, 4, 4), (4, 3, 3, 3), [2], [1], [1], 1, 0, True),
    ]:
        x = torch.randn(x_shape, dtype=torch.float64, requires_grad=True)
        w = torch.randn(w_shape, dtype=torch.float64, requires_grad=True)
        b = torch.randn(w_shape[0], dtype=torch.float64, requires_grad=True) if bias else None
        args = (x, w, b, stride, padding, dilation, groups, dim, g)
        torch.library.opcheck(torch.ops.cplib_c.tp_convolution.default, args)
        out = torch.ops.cplib_c.tp_convolution(*args)
        go = torch.randn_like(out)
        for mask in ([True, True, True], [True, False, bias]):
            torch.library.opcheck(torch.ops.cplib_c.tp_convolution_backward.default,
                                  (go, x.detach(), w.detach(), stride, padding, dilation, groups,
                                   dim, g, mask))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_opcheck(ranks, world_size):
    ranks(world_size).run(_check_opcheck)


def _conv_block(x, w, b, name):
    y = cplib.tp_conv(x * 2, w, b, padding=1, dim=-1, group=name)
    return torch.tanh(y).sum(dim=1)


def _check_compiled(backend: str) -> None:
    rank, n = dist.get_rank(), dist.get_world_size()
    x = _rand((2, 3, 4, 6 * n), torch.float32, 8).chunk(n, -1)[rank].clone().requires_grad_(True)
    w = _rand((4, 3, 3, 3), torch.float32, 9).requires_grad_(True)
    b = _rand((4,), torch.float32, 10).requires_grad_(True)
    x2, w2, b2 = (t.detach().clone().requires_grad_(True) for t in (x, w, b))
    torch._dynamo.reset()
    compiled = torch.compile(_conv_block, backend=backend, fullgraph=True)
    e = _conv_block(x, w, b, _group())
    c = compiled(x2, w2, b2, _group())
    assert_close(c, e, atol=1e-5, rtol=1e-5, what="compiled out")
    e.square().sum().backward()
    c.square().sum().backward()
    for got, want, what in ((x2.grad, x.grad, "x"), (w2.grad, w.grad, "w"), (b2.grad, b.grad, "b")):
        assert_close(got, want, atol=1e-5, rtol=1e-5, what=f"compiled grad {what}")


@pytest.mark.parametrize("world_size,backend", [(1, "aot_eager"), (2, "aot_eager"),
                                                (4, "aot_eager"), (2, "inductor")])
def test_compile_fullgraph(ranks, world_size, backend):
    ranks(world_size).run(_check_compiled, backend)


def _expect(exc, fn, *args, match: str, **kwargs) -> str:
    with pytest.raises(exc, match=match) as info:
        fn(*args, **kwargs)
    return str(info.value)


def _check_bad_inputs() -> list[str]:
    g = _group()
    x = torch.randn(2, 3, 4, 6)
    w = torch.randn(4, 3, 3, 3)
    tc = cplib.tp_conv
    msgs = [
        _expect(ValueError, tc, x, w, dilation=0, group=g, match="dilation"),
        _expect(ValueError, tc, x, w, padding=-1, group=g, match="padding"),
        _expect(ValueError, tc, x, w, stride=(1, 1, 1), group=g, match="stride"),
        _expect(ValueError, tc, x, w, padding="same", group=g, match="padding='same'"),
        _expect(ValueError, tc, x, torch.randn(4, 2, 3, 3), group=g, match="groups=1"),
        _expect(ValueError, tc, x, w, groups=2, group=g, match="groups=2"),
        _expect(ValueError, tc, x, w, torch.randn(5), group=g, match="bias"),
        _expect(ValueError, tc, x, w, dim=4, group=g, match="shard_dim=4"),
        _expect(ValueError, tc, x[0, 0], w[0, 0], group=g, match="3-D, 4-D or 5-D"),
        _expect(ValueError, tc, x, w.double(), group=g, match="dtype"),
        _expect(ValueError, tc, x, w, group="no-such-group", match="'no-such-group'"),
        _expect(NotImplementedError, tc, x, w, dim=1, group=g, match="shard_dim=1"),
    ]
    # Stride and width limits only apply when windows cross shard borders.
    if dist.get_world_size() > 1:
        msgs += [
            _expect(NotImplementedError, tc, x, w, stride=2, padding=1, group=g,
                    match="stride=2"),
            _expect(NotImplementedError, tc, x, w, stride=3, padding=1, group=g,
                    match="padding=1"),
            _expect(NotImplementedError, tc, x, torch.randn(4, 3, 2, 2), stride=3, group=g,
                    match="stride=3"),
            _expect(ValueError, tc, x, torch.randn(4, 3, 4, 4), stride=4, group=g,
                    match="local width 6 .* multiple of stride=4"),
            _expect(ValueError, tc, torch.randn(1, 3, 4, 2), torch.randn(4, 3, 1, 7),
                    padding=(0, 3), group=g, match="local width 2 .* halo"),
        ]
    # Nothing above reached a collective: the group still works.
    y = tc(x, w, padding=1, group=g)
    assert y.shape == (2, 4, 4, 6)
    return msgs


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_bad_input_raises_on_every_rank(ranks, world_size):
    msgs = ranks(world_size).run(_check_bad_inputs)
    assert len(msgs) == world_size and all(len(m) == len(msgs[0]) >= 12 for m in msgs)


def _check_threaded() -> int:
    """torch's threaded test group (no send/recv): the halo messages go as a
    split all-to-all there too; results and gradients are the same."""
    dtype = torch.float64
    cases = [c for c in CASES if c[0] in ("2d k3 p1 last", "2d k3 p1 dim2", "2d k4 p2 even overpad",
                                          "1d k4 p1 even", "2d no bias", "batch shard stride2 p1")]
    for case in cases:
        _check_case(case, dtype)
    return len(cases)


@pytest.mark.parametrize("world_size", [2, 4])
def test_threaded_process_group(threaded, world_size):
    assert threaded(world_size, _check_threaded) == [6] * world_size
