"""The build refuses an extension that links its own libstdc++ (it would turn
every error message into a crash): checked on two tiny shared objects. The
GPU check picks a compiler that links libstdc++ dynamically whatever CXX the
environment exports (a GPU image exports one that links it statically)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from build_support_modules import build_support_module

_check = build_support_module("libstdcxx")
carries_private_libstdcxx = _check.carries_private_libstdcxx
refuse_private_libstdcxx = _check.refuse_private_libstdcxx

SOURCE = ('#include <sstream>\n'
          'extern "C" int f(long x) {\n'
          '  std::ostringstream s; s << x; return (int)s.str().size(); }\n')


def _build(tmp_path, name: str, *flags: str) -> str:
    src = tmp_path / "f.cpp"
    src.write_text(SOURCE)
    out = str(tmp_path / name)
    subprocess.run(["g++", "-shared", "-fPIC", *flags, str(src), "-o", out], check=True)
    return out


@pytest.mark.skipif(shutil.which("g++") is None or shutil.which("readelf") is None,
                    reason="needs g++ and binutils")
def test_private_libstdcxx_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("CPLIB_ALLOW_STATIC_LIBSTDCXX", raising=False)
    shared = _build(tmp_path, "shared.so")
    static = _build(tmp_path, "static.so", "-static-libstdc++")
    assert carries_private_libstdcxx(shared) is False
    assert carries_private_libstdcxx(static) is True
    refuse_private_libstdcxx(shared)  # a normal build passes
    with pytest.raises(RuntimeError, match="CXX=/usr/bin/g\\+\\+"):
        refuse_private_libstdcxx(static)
    assert not os.path.exists(static), "the refused object must be removed"


choose_compilers = _check.choose_compilers
links_libstdcxx_dynamically = _check.links_libstdcxx_dynamically
REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def _static_gxx(tmp_path) -> str:
    """A g++ wrapper that links libstdc++ statically, as the GPU image's
    /opt/gcc/bin/g++ does."""
    path = tmp_path / "bin" / "g++"
    path.parent.mkdir()
    path.write_text('#!/bin/sh\nexec g++ -static-libstdc++ "$@"\n')
    path.chmod(0o755)
    return str(path)


needs_system_gxx = pytest.mark.skipif(
    not os.path.exists("/usr/bin/g++") or shutil.which("readelf") is None,
    reason="needs /usr/bin/g++ and binutils")


@needs_system_gxx
def test_a_statically_linking_cxx_is_replaced_by_the_system_compiler(tmp_path):
    static = _static_gxx(tmp_path)
    assert links_libstdcxx_dynamically(static) is False
    assert links_libstdcxx_dynamically("/usr/bin/g++") is True
    assert links_libstdcxx_dynamically(str(tmp_path / "missing-g++")) is False
    cc, cxx, why = choose_compilers({"CXX": static, "CC": "/opt/gcc/bin/gcc"})
    assert (cc, cxx) == ("/usr/bin/gcc", "/usr/bin/g++"), why
    assert static in why and "statically" in why
    # A CXX that links dynamically is kept, with its CC.
    assert choose_compilers({"CXX": "/usr/bin/g++", "CC": "gcc"})[:2] == ("gcc", "/usr/bin/g++")
    assert choose_compilers({})[:2] == ("/usr/bin/gcc", "/usr/bin/g++")


@needs_system_gxx
def test_gpu_check_dry_run_shows_the_system_compiler_chosen(tmp_path):
    # No prepared wheel (a checkout where `make gpu-prep` ran has one): the in-place build's path.
    env = {**os.environ, "CXX": _static_gxx(tmp_path), "CC": "/opt/gcc/bin/gcc",
           "PYTHON": sys.executable, "OUT": str(tmp_path / "out"),
           "GPU_CHECK_PREP": str(tmp_path / "no-prep")}
    out = subprocess.run([os.path.join(REPO, "benchmarks", "gpu", "run.sh"), "--dry-run"],
                         env=env, capture_output=True, text=True, timeout=120, check=True).stdout
    assert "CC=/usr/bin/gcc CXX=/usr/bin/g++" in out, out
    assert "links libstdc++ statically" in out, out
