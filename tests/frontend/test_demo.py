"""The README's demo: a short run passes with its verdict and plot, and a run
whose tolerance no curve can meet exits non-zero (the divergence path)."""

from __future__ import annotations

import os
import subprocess
import sys

from harness import cplib_import_root

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _demo(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "examples", "demo.py"), "--steps", "3", "--seq-len", "128",
           "--batch", "2", "--out", str(tmp_path / "loss.png"), *extra]
    env = dict(os.environ, PYTHONPATH=cplib_import_root() + os.pathsep
               + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def test_demo_short_run_passes_and_plots(tmp_path):
    run = _demo(tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "demo verdict: PASS" in run.stdout
    assert run.stdout.count("loss cp") == 3 and "tok/s" in run.stdout
    assert "rank 1: peak RSS" in run.stdout
    assert (tmp_path / "loss.png").stat().st_size > 1000


def test_demo_exits_nonzero_when_curves_diverge(tmp_path):
    run = _demo(tmp_path, "--atol", "-1", "--rtol", "0")  # no difference can pass
    assert run.returncode != 0
    assert "demo verdict: FAIL" in run.stdout
