"""The C halo packing core (csrc/core/halo.c) called directly through ctypes:
pack/unpack of a slab of strided (transposed, sliced) tensors of every element
size against torch's own slicing."""

from __future__ import annotations

import ctypes

import pytest
import torch

import cplib._C as native

MAX_DIMS = 8


class Slab(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("elem_size", ctypes.c_int64),
        ("ndim", ctypes.c_int),
        ("sizes", ctypes.c_int64 * MAX_DIMS),
        ("strides", ctypes.c_int64 * MAX_DIMS),
        ("dim", ctypes.c_int),
        ("start", ctypes.c_int64),
        ("width", ctypes.c_int64),
    ]


_lib = ctypes.CDLL(native.__file__)
_lib.cplib_halo_pack_cpu.argtypes = [ctypes.POINTER(Slab), ctypes.c_void_p]
_lib.cplib_halo_unpack_cpu.argtypes = [ctypes.POINTER(Slab), ctypes.c_void_p]


def _slab(t: torch.Tensor, dim: int, start: int, width: int) -> Slab:
    s = Slab()
    s.data = t.data_ptr()
    s.elem_size = t.element_size()
    s.ndim = t.dim()
    for d in range(t.dim()):
        s.sizes[d] = t.shape[d]
        s.strides[d] = t.stride(d)
    s.dim, s.start, s.width = dim, start, width
    return s


LAYOUTS = ["contiguous", "transposed", "sliced"]


def _tensor(shape, dtype, layout) -> torch.Tensor:
    base = torch.arange(torch.Size(shape).numel() * 2, dtype=torch.float64).to(dtype)
    if layout == "contiguous":
        return base[: torch.Size(shape).numel()].view(shape)
    if layout == "transposed":  # innermost stride != 1
        return base[: torch.Size(shape).numel()].view(shape[::-1]).permute(
            *reversed(range(len(shape))))
    big = list(shape)
    big[-1] *= 2
    return base.view(big)[..., ::2]  # every other element: stride 2 inside


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape,dim,start,width", [
    ((2, 3, 5, 7), 3, 5, 2), ((2, 3, 5, 7), 2, 0, 3), ((4, 6), 0, 1, 2),
    ((2, 2, 3, 4, 5), 4, 0, 5), ((3, 4), 1, 2, 0), ((1, 2, 3, 4, 5, 6), 3, 1, 2),
])
def test_pack_unpack_roundtrip(dtype, layout, shape, dim, start, width):
    t = _tensor(shape, dtype, layout)
    want = t.narrow(dim, start, width).contiguous()
    buf = torch.full(want.shape, 7, dtype=dtype)
    assert _lib.cplib_halo_pack_cpu(ctypes.byref(_slab(t, dim, start, width)), buf.data_ptr()) == 0
    assert torch.equal(buf, want)

    dst = _tensor(shape, dtype, layout).zero_()  # same strides as t
    src = (buf.to(torch.float64) + 1).to(dtype)
    assert _lib.cplib_halo_unpack_cpu(ctypes.byref(_slab(dst, dim, start, width)),
                                      src.data_ptr()) == 0
    expect = torch.zeros(shape, dtype=dtype)
    expect.narrow(dim, start, width).copy_(src)
    assert torch.equal(dst.contiguous(), expect)


def test_rejects_bad_slabs():
    t = torch.zeros(2, 3)
    buf = torch.zeros(6)
    for dim, start, width in [(2, 0, 1), (1, 2, 2), (1, -1, 1), (0, 0, -1)]:
        assert _lib.cplib_halo_pack_cpu(ctypes.byref(_slab(t, dim, start, width)),
                                        buf.data_ptr()) == 1
    s = _slab(t, 1, 0, 1)
    s.elem_size = 3
    assert _lib.cplib_halo_unpack_cpu(ctypes.byref(s), buf.data_ptr()) == 1
