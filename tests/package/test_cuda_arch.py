"""The CUDA architectures in a built library, read from its fat binaries
(build_support/cuda_arch.py; no cuobjdump on CI machines): the reader on an
object nvcc builds here for sm_80, sm_90 and sm_100 + PTX, then the CUDA
wheel itself, which must carry SASS for sm_80, sm_90, sm_100 and PTX for
sm_100. CI checks the wheel right after building it (`make cuda-wheel
cuda-arch-check` in .ci/run's CUDA stage); here it is checked when one is
present (dist/cuda/ or the GPU check's .gpu-prep/)."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "build_support"))
from cuda_arch import architectures  # noqa: E402

WANT = {"sm": [80, 90, 100], "ptx": [100]}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found (CI has it)")
def test_reader_finds_every_architecture_nvcc_built(tmp_path):
    src = tmp_path / "k.cu"
    src.write_text("__global__ void k(float* x) { x[threadIdx.x] += 1.0f; }\n"
                   "extern \"C\" void launch(float* x) { k<<<1, 32>>>(x); }\n")
    so = tmp_path / "k.so"
    subprocess.run(["nvcc", "-shared", "-Xcompiler", "-fPIC",
                    "-gencode", "arch=compute_80,code=sm_80",
                    "-gencode", "arch=compute_90,code=sm_90",
                    "-gencode", "arch=compute_100,code=[sm_100,compute_100]",
                    str(src), "-o", str(so)], check=True, capture_output=True, timeout=300)
    assert architectures(str(so)) == WANT
    subprocess.run(["nvcc", "-shared", "-Xcompiler", "-fPIC", "-gencode",
                    "arch=compute_90,code=compute_90", str(src), "-o", str(so)], check=True,
                   capture_output=True, timeout=300)
    assert architectures(str(so)) == {"sm": [], "ptx": [90]}


def test_reader_on_the_installed_extension():
    """No CUDA code in a CPU build; SASS in a CUDA build."""
    import torch

    import cplib

    found = architectures(cplib._C.__file__)
    if torch._C._dispatch_has_kernel_for_dispatch_key("cplib_c::ring_sdpa", "CUDA"):
        assert found["sm"], found
    else:
        assert found == {"sm": [], "ptx": []}


def _cuda_wheels() -> list[str]:
    return sorted(glob.glob(os.path.join(REPO, "dist", "cuda", "cplib-*-abi3-*.whl"))
                  + glob.glob(os.path.join(REPO, ".gpu-prep", "cplib-*-abi3-*.whl")))


@pytest.mark.skipif(not _cuda_wheels(), reason="no CUDA build present (make cuda-wheel; CI's "
                                               "CUDA stage checks it with make cuda-arch-check)")
def test_cuda_wheel_carries_sm80_sm90_sm100_and_ptx():
    for wheel in _cuda_wheels():
        assert architectures(wheel) == WANT, wheel
