"""cplib's own CUDA kernels (csrc/cuda/merge.cu, combine.cu, halo.cu) on the
GPU against their C twins on the CPU, which tests/merge/test_merge.py,
tests/merge/test_combine.py and tests/conv/test_halo.py check against
references. Small shapes, every layout,
dtype and edge row those tests use, so that compute-sanitizer's memcheck
covers the kernels' whole index space in seconds:

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \\
        python3 benchmarks/gpu/kernels_check.py

(without the caching allocator every tensor is its own allocation, so an
access past a tensor's end is an error memcheck sees). Exits non-zero on any
mismatch; prints one line per kernel with the number of cases.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The tests' helpers and the two test modules read below only: cplib is the one
# installed (or the tree's, through PYTHONPATH, when built in place), never the
# tree's by default.
for folder in ("support", "conv", "merge"):
    sys.path.insert(0, os.path.join(ROOT, "tests", folder))

import cplib  # noqa: E402
import test_combine  # noqa: E402  (its cases: parts over any rows, -inf rows, dtypes)
import test_halo  # noqa: E402  (its ctypes view of the C API: Slab, _slab, _tensor)
import test_merge  # noqa: E402  (its merge cases: -inf rows, strided blocks)
from cplib.merge.op import combine_partials_  # noqa: E402


def check_merge(dev: torch.device) -> int:
    cases = 0
    for (acc, blk), strided, (l, r, row0) in itertools.product(
            [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
             (torch.float32, torch.float16), (torch.float64, torch.float64)],
            (False, True), [(11, 5, 4), (64, 64, 0), (130, 33, 97)]):
        out, lse, blk_out, blk_lse, row0 = test_merge._case(acc, blk, L=l, R=r, row0=row0,
                                                            strided=strided, seed=cases)
        gpu = [t.to(dev) for t in (out, lse)]
        # .to(dev) keeps the block's strides (a strided CPU tensor stays strided).
        cplib.merge_partial_(*gpu, blk_out.to(dev), blk_lse.to(dev), row0)
        cplib.merge_partial_(out, lse, blk_out, blk_lse, row0)
        torch.cuda.synchronize(dev)
        tol = 1e-12 if acc == torch.float64 else 2e-6
        for name, got, want in (("out", gpu[0], out), ("lse", gpu[1], lse)):
            torch.testing.assert_close(got.cpu(), want, atol=tol, rtol=tol, equal_nan=False,
                                       msg=lambda m: f"CUDA merge {name} {acc}/{blk} "
                                                     f"strided={strided} L={l} R={r}: {m}")
        cases += 1
    return cases


def check_combine(dev: torch.device) -> int:
    """The vectorised kernel (head dim 24, dense and (B, L, H, D) rows) and
    the one-element one (head dim 5), weighted and plain, with an
    accumulator part and in place: 31 launches, few enough for memcheck's
    time."""
    cases = 0
    for (out_dt, part_dt, acc_part), (strided, dim), weighted in itertools.product(
            [(torch.float32, torch.float32, False), (torch.bfloat16, torch.bfloat16, False),
             (torch.float16, torch.float16, True), (torch.float32, torch.bfloat16, True),
             (torch.float64, torch.float64, False)], [(False, 24), (True, 24), (False, 5)],
            (True, False)):
        parts, lses, offsets, rows, _ = test_combine.case(
            out_dt, part_dt, dim=dim, acc_part=acc_part, strided=strided,
            no_key_rows=weighted, seed=cases)
        acc = torch.float64 if out_dt == torch.float64 else torch.float32
        b, h = parts[0].shape[:2]
        results = []
        for where in (torch.device("cpu"), dev):
            out = torch.full((b, h, rows, dim), 7.0, dtype=out_dt, device=where)
            lse = torch.full((b, h, rows), 7.0, dtype=acc, device=where)
            combine_partials_(out, lse if weighted else None, [t.to(where) for t in parts],
                              [t.to(where) for t in lses] if weighted else None, offsets)
            results.append((out.cpu(), lse.cpu()))
        torch.cuda.synchronize(dev)
        (c_out, c_lse), (g_out, g_lse) = results
        tol = 1e-12 if out_dt == torch.float64 else 2e-6
        what = f"CUDA combine {out_dt}/{part_dt} strided={strided} dim={dim} weighted={weighted}"
        if weighted:
            torch.testing.assert_close(g_lse, c_lse, atol=tol, rtol=tol,
                                       msg=lambda m: f"{what}: {m}")
        # half outputs: one rounding of nearly equal float32 values (a tie may fall either way)
        eps = 0.0 if out_dt in (torch.float32, torch.float64) else torch.finfo(out_dt).eps
        diff = (g_out.double() - c_out.double()).abs()
        bound = tol + eps * c_out.double().abs()
        assert (diff <= bound).all(), f"{what}: {diff.max()}"
        cases += 1
    # in place: the accumulator is part 0 and the output
    acc = torch.randn(2, 3, 40, 16, device=dev)
    part = torch.randn(2, 3, 9, 16, device=dev).bfloat16()
    lse0, lse1 = torch.randn(2, 3, 40, device=dev), torch.randn(2, 3, 9, device=dev)
    want = torch.empty_like(acc)
    combine_partials_(want, torch.empty_like(lse0), [acc, part], [lse0, lse1], [0, 31])
    combine_partials_(acc, torch.empty_like(lse0), [acc, part], [lse0, lse1], [0, 31])
    torch.cuda.synchronize(dev)
    assert torch.equal(acc, want), "CUDA combine in place"
    return cases + 1


def check_halo(dev: torch.device) -> int:
    lib = test_halo._lib
    lib.cplib_halo_pack_cuda.argtypes = [ctypes.POINTER(test_halo.Slab), ctypes.c_void_p,
                                         ctypes.c_void_p]
    lib.cplib_halo_unpack_cuda.argtypes = lib.cplib_halo_pack_cuda.argtypes
    stream = ctypes.c_void_p(torch.cuda.current_stream(dev).cuda_stream)
    cases = 0
    shapes = [((2, 3, 5, 7), 3, 5, 2), ((2, 3, 5, 7), 2, 0, 3), ((4, 6), 0, 1, 2),
              ((2, 2, 3, 4, 5), 4, 0, 5), ((1, 2, 3, 4, 5, 6), 3, 1, 2),
              ((2, 8, 33, 65), 3, 63, 2)]
    for dtype, layout, (shape, dim, start, width) in itertools.product(
            [torch.float64, torch.float32, torch.bfloat16, torch.uint8], test_halo.LAYOUTS,
            shapes):
        t = _tensor_on(shape, dtype, layout, dev)
        want = t.narrow(dim, start, width).contiguous()
        buf = torch.full(want.shape, 7, dtype=dtype, device=dev)
        rc = lib.cplib_halo_pack_cuda(ctypes.byref(test_halo._slab(t, dim, start, width)),
                                      buf.data_ptr(), stream)
        torch.cuda.synchronize(dev)
        assert rc == 0 and torch.equal(buf, want), f"CUDA pack {dtype} {layout} {shape} {dim}"
        dst = _tensor_on(shape, dtype, layout, dev).zero_()
        src = (buf.to(torch.float64) + 1).to(dtype)
        rc = lib.cplib_halo_unpack_cuda(ctypes.byref(test_halo._slab(dst, dim, start, width)),
                                        src.data_ptr(), stream)
        torch.cuda.synchronize(dev)
        expect = torch.zeros(shape, dtype=dtype, device=dev)
        expect.narrow(dim, start, width).copy_(src)
        assert rc == 0 and torch.equal(dst.contiguous(), expect), \
            f"CUDA unpack {dtype} {layout} {shape} {dim}"
        cases += 1
    return cases


def _tensor_on(shape, dtype, layout, dev) -> torch.Tensor:
    """test_halo's strided layouts, built on the device (same strides)."""
    cpu = test_halo._tensor(shape, dtype, layout)
    base = torch.empty(cpu.untyped_storage().nbytes() // cpu.element_size(), dtype=dtype,
                       device=dev)
    base.copy_(torch.as_strided(cpu, (base.numel(),), (1,), 0))
    return torch.as_strided(base, cpu.shape, cpu.stride(), cpu.storage_offset())


def main() -> int:
    if not torch.cuda.is_available():
        print("kernels_check: no CUDA GPU visible; nothing checked")
        return 1
    if not torch._C._dispatch_has_kernel_for_dispatch_key("cplib_c::merge_partial_", "CUDA"):
        print("kernels_check: cplib was built without CUDA (no CUDA kernel for merge_partial_)")
        return 1
    dev = torch.device("cuda", 0)
    print(f"kernels_check: merge {check_merge(dev)} cases OK", flush=True)
    print(f"kernels_check: combine {check_combine(dev)} cases OK", flush=True)
    print(f"kernels_check: halo pack/unpack {check_halo(dev)} cases OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
