"""Runs one setup stage with a one-line status instead of its whole output.

    python build_support/quiet.py LOG "building cplib._C" -- CMD [ARGS...]

Everything CMD prints goes to LOG. The terminal gets one line for the stage,
updated with ninja's progress count (``[7/25]``) while it compiles, and the
time it took. If CMD fails, the end of LOG (from the first error on) is
printed, with the log's path, and the exit status is CMD's. ``CPLIB_VERBOSE=1``
shows everything instead.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

_PROGRESS = re.compile(rb"^\s*\[(\d+)/(\d+)\] ")
_ERROR = re.compile(rb"error|Error|ERROR|FAILED")


def _status(label: str, detail: str, final: bool) -> None:
    line = f"{label} ... {detail}"
    if sys.stdout.isatty():
        sys.stdout.write("\r\033[K" + line + ("\n" if final else ""))
    elif final:
        sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _failure_excerpt(log: str, max_lines: int = 80) -> str:
    with open(log, "rb") as fh:
        lines = fh.read().splitlines()
    first = next((i for i, ln in enumerate(lines) if _ERROR.search(ln)), max(0, len(lines) - 40))
    excerpt = lines[max(0, first - 5):][:max_lines]
    return b"\n".join(excerpt).decode("utf-8", "replace")


def main(argv: list[str]) -> int:
    if len(argv) < 5 or argv[3] != "--":
        print(__doc__.strip(), file=sys.stderr)
        return 64
    log, label, cmd = argv[1], argv[2], argv[4:]
    if os.environ.get("CPLIB_VERBOSE") == "1":
        return subprocess.call(cmd)
    os.makedirs(os.path.dirname(os.path.abspath(log)), exist_ok=True)
    start = time.monotonic()
    _status(label, "", final=False)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            m = _PROGRESS.match(line)
            if m:
                _status(label, f"[{int(m[1])}/{int(m[2])}]", final=False)
        rc = proc.wait()
    secs = time.monotonic() - start
    if rc == 0:
        _status(label, f"done in {secs:.0f} s (log: {os.path.relpath(log)})", final=True)
        return 0
    _status(label, f"FAILED after {secs:.0f} s (exit {rc})", final=True)
    sys.stdout.write(_failure_excerpt(log) + f"\n(full log: {log})\n")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv))
