"""examples/hf_train.py: a short run with HF's own loss
(``model(..., labels=labels).loss``) on packed documents placed with the
document placement tracks the same training in one process step by step
(PASS), and a tolerance no run can meet gives FAIL and a non-zero exit."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from harness import cplib_import_root

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytest.importorskip("transformers", reason="requirements-dev.txt pins it (make build installs it)")


def _train(*extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "examples", "hf_train.py"), "--model", "qwen3", "--steps", "3",
           "--seq-len", "64", *extra]
    env = dict(os.environ, PYTHONPATH=cplib_import_root() + os.pathsep
               + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def test_hf_train_with_labels_and_placement_tracks_one_process():
    run = _train()
    assert run.returncode == 0, run.stdout + run.stderr
    assert "documents=True, loss = model(..., labels=labels).loss" in run.stdout
    assert run.stdout.count("loss cp") == 3 and "hf_train verdict: PASS" in run.stdout


def test_hf_train_exits_nonzero_when_losses_diverge():
    run = _train("--steps", "1", "--atol", "-1", "--rtol", "0")
    assert run.returncode != 0 and "hf_train verdict: FAIL" in run.stdout
