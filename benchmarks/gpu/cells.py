"""A benchmark's cells, each under its own time limit, measured in a worker
subprocess, results written as they arrive.

A cell is one measurement (one variant of one configuration). The driver
(``run_cells``) starts a worker process (``worker_main`` inside the same
script, with the cells' list in a file); the worker appends one JSON line
when it starts a cell and one with the cell's value (seconds, a dict, or an
error string) when it ends it. The driver reads those lines as they come;
a cell that does not end within ``cell_timeout`` seconds (a hang in CUDA, a
threaded process group waiting forever) costs that cell only: the driver
kills the worker and every process under it (reap.kill_tree), marks the
cell "timed out", and starts a new worker on the cells left. The worker
stays in the driver's process group (no new session), so a kill of the whole
stage (run.sh's limit) ends it with the driver. A worker that dies (a crash, a sticky CUDA
error: the worker exits after an error that leaves the device unusable)
marks its running cell and is replaced the same way. Cells not started
before ``deadline`` are "skipped: time budget". ``on_result`` is called after
every cell, so the caller can rewrite its JSON row by row.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

from reap import kill_tree

TIMED_OUT = "timed out"
SKIPPED = "skipped: time budget"


def _kill(proc: subprocess.Popen) -> None:
    kill_tree(proc.pid)
    proc.wait()


def _read_lines(path: str, offset: int) -> tuple[list[dict], int]:
    try:
        with open(path) as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return [], offset
    complete = data[: data.rfind("\n") + 1]
    lines = []
    for line in complete.splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:
            continue
    return lines, offset + len(complete)


def _one_worker(cells: list[dict], todo: list[int], worker_argv: list[str], tmp: str,
                attempt: int, cell_timeout: float, start_timeout: float, deadline: float,
                record: Callable[[int, Any], None], log: Callable[[str], None]) -> bool:
    """One worker over the cells ``todo``; returns whether it started any."""
    spec = os.path.join(tmp, f"cells-{attempt}.json")
    progress = os.path.join(tmp, f"progress-{attempt}.jsonl")
    with open(spec, "w") as f:
        json.dump({"deadline": deadline, "cells": [dict(cells[i], index=i) for i in todo]}, f)
    proc = subprocess.Popen([*worker_argv, "--worker", spec, progress])
    running, since, limit, started, offset = None, time.time(), start_timeout, False, 0
    killed = False
    while True:
        exited = proc.poll() is not None
        lines, offset = _read_lines(progress, offset)
        for rec in lines:
            started = True
            if "start" in rec:
                running, since, limit = rec["start"], time.time(), cell_timeout
            else:
                record(rec["done"], rec["value"])
                running, since, limit = None, time.time(), cell_timeout
        if exited and not lines:
            break
        if time.time() - since > limit:
            _kill(proc)
            killed = True
            break
        time.sleep(0.2)
    if running is not None:
        how = (f"{TIMED_OUT} after {time.time() - since:.0f} s (limit {cell_timeout:.0f} s)"
               if killed else f"the worker died (exit {proc.returncode})")
        record(running, f"error: {how}")
        log(f"cells: {cells[running]['label']}: {how}; a new worker takes the rest")
    elif killed or proc.returncode:
        log(f"cells: the worker ended (exit {proc.returncode}"
            f"{', no cell started in ' + str(int(start_timeout)) + ' s' if killed else ''})")
    return started


def run_cells(cells: list[dict], worker_argv: list[str], *, cell_timeout: float,
              deadline: float, start_timeout: float = 120.0,
              on_result: Callable[[int, Any], None] = lambda i, v: None,
              log: Callable[[str], None] = print) -> list[Any]:
    """Runs every cell; returns their values in order (see the module doc).
    ``worker_argv`` + ``["--worker", SPEC, PROGRESS]`` must call worker_main."""
    results: list[Any] = [None] * len(cells)
    todo = list(range(len(cells)))

    def record(i: int, value: Any) -> None:
        if i in todo:
            todo.remove(i)
            results[i] = value
            on_result(i, value)
    with tempfile.TemporaryDirectory(prefix="bench-cells-") as tmp:
        attempt, idle = 0, 0
        while todo and time.time() < deadline:
            attempt += 1
            if _one_worker(cells, todo, worker_argv, tmp, attempt, cell_timeout, start_timeout,
                           deadline, record, log):
                idle = 0
            else:
                idle += 1
                if idle == 2:  # two workers in a row that started nothing: give up
                    for i in list(todo):
                        record(i, "error: no worker started a cell (see the log)")
        if todo:
            log(f"cells: {len(todo)} not started (time budget)")
            for i in list(todo):
                record(i, SKIPPED)
    return results


def worker_main(spec: str, progress: str, run_cell: Callable[[dict], Any],
                device_broken: Callable[[], bool]) -> int:
    """The worker's loop: every cell of ``spec`` through ``run_cell``, one
    JSON line at its start and one with its value; exits after a cell that
    left the device unusable (``device_broken``) so that a fresh process
    takes the rest."""
    with open(spec) as f:
        loaded = json.load(f)
    cells, deadline = loaded["cells"], loaded["deadline"]

    def emit(rec: dict) -> None:
        with open(progress, "a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())
    for cell in cells:
        if time.time() >= deadline:
            emit({"done": cell["index"], "value": SKIPPED})
            continue
        emit({"start": cell["index"]})
        try:
            value = run_cell(cell)
        except Exception as exc:  # noqa: BLE001 - every failure becomes the cell's value
            value = f"error: {type(exc).__name__}: {str(exc).strip().splitlines()[-1][:160]}"
        emit({"done": cell["index"], "value": value})
        if isinstance(value, str) and value.startswith("error") and device_broken():
            print(f"worker: the device is unusable after {cell['label']}: exiting", flush=True)
            return 3
    return 0


if __name__ == "__main__":
    sys.exit("cells.py is a library: see benchmarks/bench_ring_gpu.py")
