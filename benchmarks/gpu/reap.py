"""Ends what a step of the GPU check left running, so that nothing holds the
GPU through the later steps.

* ``reap(token)``: every process whose environment carries
  ``GPU_CHECK_STAGE=<token>``. run.sh gives each step's command a token of
  its own; children inherit it, also those that left the step's process
  group or session (``setsid``), which the step's ``timeout`` cannot reach.
* ``kill_tree(pid)``: a process and all its descendants (cells.py ends a
  cell's worker this way: the worker stays in the driver's process group, so
  the stage's kill reaches it too).

``python benchmarks/gpu/reap.py TOKEN`` reaps and prints what it ended (one
line, nothing when nothing was left). Linux only (reads /proc).
"""

from __future__ import annotations

import os
import signal
import sys
import time

TOKEN_VAR = "GPU_CHECK_STAGE"


def _pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def _parent_and_state(pid: int) -> tuple[int, str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
    fields = stat[stat.rfind(")") + 2:].split()
    return int(fields[1]), fields[0]


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children first, then theirs)."""
    children: dict[int, list[int]] = {}
    for p in _pids():
        info = _parent_and_state(p)
        if info is not None:
            children.setdefault(info[0], []).append(p)
    found, queue = [], list(children.get(pid, []))
    while queue:
        p = queue.pop(0)
        found.append(p)
        queue += children.get(p, [])
    return found


def _alive(pid: int) -> bool:
    info = _parent_and_state(pid)
    return info is not None and info[1] != "Z"


def _kill_all(pids: list[int], wait_s: float = 5.0) -> list[int]:
    """SIGKILL to each of ``pids``; waits until they are gone (zombies count
    as gone: they hold no memory). Returns those that were alive."""
    killed = []
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
            killed.append(p)
        except (ProcessLookupError, PermissionError):
            pass
    end = time.time() + wait_s
    while time.time() < end and any(_alive(p) for p in killed):
        time.sleep(0.05)
    return killed


def kill_tree(pid: int) -> list[int]:
    """Kills ``pid`` and every descendant (collected first, so that none is
    reparented out of reach by its parent's death)."""
    return _kill_all([pid] + descendants(pid))


def carrying(token: str) -> list[int]:
    """The processes whose environment has ``GPU_CHECK_STAGE=token``."""
    mark = f"{TOKEN_VAR}={token}".encode()
    me = {os.getpid(), os.getppid()}
    found = []
    for p in _pids():
        if p in me:
            continue
        try:
            with open(f"/proc/{p}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:  # gone, or not ours
            continue
        if mark in env:
            found.append(p)
    return found


def reap(token: str) -> list[int]:
    """Kills every process that carries ``token``; returns their pids."""
    return _kill_all(carrying(token))


if __name__ == "__main__":
    if len(sys.argv) != 2 or not sys.argv[1]:
        sys.exit("usage: reap.py TOKEN")
    ended = reap(sys.argv[1])
    if ended:
        print(f"gpu-check: ended {len(ended)} processes the step left running "
              f"(pids {' '.join(map(str, ended))})")
