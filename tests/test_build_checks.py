"""The build refuses an extension that links its own libstdc++ (it would turn
every error message into a crash): checked on two tiny shared objects."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess

import pytest


def _load_build_check():
    """build_support/libstdcxx.py by its path: putting the repository root on
    sys.path would make every later test (and its rank processes) import the
    source tree's cplib instead of the one under test."""
    path = os.path.join(os.path.dirname(__file__), "..", "build_support", "libstdcxx.py")
    spec = importlib.util.spec_from_file_location("cplib_build_libstdcxx", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_check = _load_build_check()
carries_private_libstdcxx = _check.carries_private_libstdcxx
refuse_private_libstdcxx = _check.refuse_private_libstdcxx

SOURCE = '#include <sstream>\nextern "C" int f(long x) { std::ostringstream s; s << x; return (int)s.str().size(); }\n'


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
