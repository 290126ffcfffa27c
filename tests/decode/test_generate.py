"""examples/generate.py at a small size: CP prefill (pass-KV), a follow-up
chunk over the sharded cache (pass-Q, picked by "auto") and 32 greedy decode
steps give the token ids of one process, and the example says PASS."""

from __future__ import annotations

import os
import subprocess
import sys

from harness import cplib_import_root

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_generate_matches_one_process():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           os.path.join(ROOT, "examples", "generate.py"), "--prompt-len", "203",
           "--chunk-len", "9", "--new-tokens", "32", "--debug"]
    env = dict(os.environ, PYTHONPATH=cplib_import_root() + os.pathsep
               + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "generate verdict: PASS" in run.stdout, out
    assert "ring_pass auto -> 'q'" in run.stdout, out
    assert "ring_pass='auto' chose 'q'" in out, out  # the debug log line of every rank
    assert "time to first token" in run.stdout and "tok/s" in run.stdout, out
    rows = next(line for line in run.stdout.splitlines() if line.startswith("cached rows"))
    counts = [int(x) for x in rows.split(":")[1].split("(")[0].split(",")]
    assert max(counts) - min(counts) <= 1 and sum(counts) == 203 + 9 + 31, rows
