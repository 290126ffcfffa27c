"""Build cplib: the C11 core is compiled by the C compiler, CUDA sources by
nvcc (through torch's builder), and the thin C++ glue into the cplib._C module.

The native layer is on LibTorch's stable ABI and Python's limited API: one
binary (an abi3 wheel) serves every torch from 2.11 and every CPython from 3.11.

Environment:
  CPLIB_CUDA=1/0      force the CUDA build on/off (default: on when torch is a
                      CUDA build and nvcc is found)
  CPLIB_BUILD_BASE    setuptools' build folder (default: build)
  TORCH_CUDA_ARCH_LIST  defaults to "8.0;9.0;10.0+PTX" (A100, H100/H200, B200, and
                      PTX for later GPUs) when no GPU is visible; where one is,
                      torch builds for it alone
  CPLIB_DEBUG=1       -O0 -g
"""

import glob
import os
import shutil
import subprocess
import sys
import sysconfig

from setuptools import setup

import torch
from torch.utils import cpp_extension

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from build_support.libstdcxx import refuse_private_libstdcxx  # noqa: E402

# The CUDA wheel's architectures (build_support/cuda_arch.py reads them back;
# `make cuda-arch-check` requires sm_80, sm_90, sm_100 and PTX 100).
CUDA_ARCHS = "8.0;9.0;10.0+PTX"
ROOT = os.path.dirname(os.path.abspath(__file__))
INCLUDE = os.path.join(ROOT, "csrc", "include")
DEBUG = os.environ.get("CPLIB_DEBUG", "0") == "1"
OPT = ["-O0", "-g"] if DEBUG else ["-O3"]
# Host compilers: Python's own CFLAGS add -g, which makes _C.so several times
# larger and every compile slower; -g0 (last wins) drops it.
HOST_OPT = OPT if DEBUG else [*OPT, "-g0"]
# The C core's float loops (the merges' exp/log1p weights) vectorise only
# when a compare or a product may be computed in every lane: GCC keeps such a
# loop scalar while FP exceptions may trap. cplib never reads the FP flags;
# values are unchanged (IEEE results, no reassociation, no fast-math).
C_FP = ["-fno-trapping-math"]
# The oldest torch the one binary serves (2.11.0).
TORCH_TARGET_VERSION = "0x020b000000000000"


def _rel(paths):
    return sorted(os.path.relpath(p, ROOT) for p in paths)


def _want_cuda() -> bool:
    forced = os.environ.get("CPLIB_CUDA")
    if forced is not None:
        return forced.lower() in ("1", "on", "true", "yes")
    return torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None


class BuildExt(cpp_extension.BuildExtension):
    """Compiles csrc/core/*.c with the C compiler as C11 (torch's builder would
    compile them as C++) and links the objects into every extension."""

    def finalize_options(self):
        super().finalize_options()
        # One object folder per torch build: objects compiled against one
        # torch's headers never end up linked against another's.
        tag = "torch-" + torch.__version__.replace("+", "-")
        if os.path.basename(self.build_temp) != tag:
            self.build_temp = os.path.join(self.build_temp, tag)

    def build_extensions(self):
        # CC may carry a launcher or flags ("ccache gcc", "gcc -pthread").
        cc = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()
        if shutil.which(cc[0]) is None:
            cc = ["cc"]
        objdir = os.path.join(self.build_temp, "core")
        os.makedirs(objdir, exist_ok=True)
        objects = []
        for src in sorted(glob.glob(os.path.join(ROOT, "csrc", "core", "*.c"))):
            obj = os.path.join(objdir, os.path.basename(src)[:-2] + ".o")
            cmd = [*cc, "-std=c11", *HOST_OPT, *C_FP, "-fPIC", "-fopenmp", "-Wall", "-Wextra",
                   "-I" + INCLUDE, "-c", src, "-o", obj]
            print(" ".join(cmd))
            subprocess.check_call(cmd)
            objects.append(obj)
        for ext in self.extensions:
            ext.extra_objects = list(ext.extra_objects or []) + objects
        super().build_extensions()
        for ext in self.extensions:
            refuse_private_libstdcxx(self.get_ext_fullpath(ext.name))


def _extension():
    # csrc/torch/ is grouped by feature (ring/, conv/, comm/, ...); includes
    # name the folder, relative to csrc/torch.
    sources = _rel(glob.glob(os.path.join(ROOT, "csrc", "torch", "**", "*.cpp"), recursive=True))
    # torch picks the C++ standard its headers need (C++17 or C++20).
    cxx = [*HOST_OPT, "-fopenmp", "-Wall", "-Wextra", "-Wno-unused-parameter"]
    # The stable ABI: the binary runs on every torch from TORCH_TARGET_VERSION on.
    macros = [("TORCH_TARGET_VERSION", TORCH_TARGET_VERSION)]
    kwargs = dict(
        name="cplib._C",
        # setuptools relinks only when a file here is newer than the module:
        # the sources alone would miss the C core (linked as objects), every
        # header and this file's flags, and leave a stale _C.so in place.
        depends=[*_rel(f for f in glob.glob(os.path.join(ROOT, "csrc", "**", "*"), recursive=True)
                       if os.path.isfile(f)), "setup.py"],
        include_dirs=[INCLUDE, os.path.join(ROOT, "csrc", "torch")],
        # torch's builder then defines Py_LIMITED_API and links no
        # libtorch_python: the module is an abi3 one.
        py_limited_api=True,
        extra_link_args=["-fopenmp"],
    )
    if _want_cuda():
        if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
            os.environ["TORCH_CUDA_ARCH_LIST"] = CUDA_ARCHS
        sources += _rel(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu")))
        return cpp_extension.CUDAExtension(
            sources=sources,
            define_macros=[*macros, ("CPLIB_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx, "nvcc": [*OPT, "--use_fast_math"]},
            **kwargs,
        )
    return cpp_extension.CppExtension(sources=sources, define_macros=macros,
                                      extra_compile_args={"cxx": cxx}, **kwargs)


def _options():
    # A wheel tagged abi3 (CPython >= 3.11), and CPLIB_BUILD_BASE for a build
    # folder of its own (the CUDA wheel is built beside the CPU one).
    options = {"bdist_wheel": {"py_limited_api": "cp311"}}
    if os.environ.get("CPLIB_BUILD_BASE"):
        options["build"] = {"build_base": os.environ["CPLIB_BUILD_BASE"]}
    return options


setup(
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExt.with_options(use_ninja=True)},
    options=_options(),
)
