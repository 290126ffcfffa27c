"""Accuracy of the C core's vectorisable exp/log1p (csrc/core/vecmath.h),
which the fused merge uses for its weights: a C sweep against libm in double."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> dict[str, float]:
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        pytest.fail("no C compiler: the build needs one too")
    exe = str(tmp_path_factory.mktemp("vecmath") / "vecmath_accuracy")
    subprocess.run([cc, "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror",
                    "-I", os.path.join(ROOT, "csrc", "core"),
                    os.path.join(ROOT, "tests", "merge", "vecmath_accuracy.c"), "-o", exe, "-lm"],
                   check=True)
    words = subprocess.run([exe], check=True, capture_output=True, text=True).stdout.split()
    return {words[i]: float(words[i + 1]) for i in range(0, len(words), 2)}


def test_exp_within_two_ulp(sweep):
    assert sweep["exp_ulp"] <= 2.0, sweep


def test_log1p_within_two_ulp(sweep):
    assert sweep["log1p_ulp"] <= 2.0, sweep


def test_edge_values(sweep):
    # exp(-inf) = exp(NaN) = 0 (the merge's empty rows), exp(0) = 1, log1p(0) = 0
    assert sweep["edges_ok"] == 1.0, sweep
