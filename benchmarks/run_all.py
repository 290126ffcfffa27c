"""Runs every benchmarks/bench_*.py in turn (``make bench``)."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

here = os.path.dirname(os.path.abspath(__file__))
failed = []
for script in sorted(glob.glob(os.path.join(here, "bench_*.py"))):
    print(f"\n=== {os.path.basename(script)}", flush=True)
    if subprocess.run([sys.executable, script]).returncode != 0:
        failed.append(os.path.basename(script))
if failed:
    sys.exit(f"failed: {', '.join(failed)}")
