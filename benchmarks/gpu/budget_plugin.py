"""pytest plugin of the GPU check's tests stage (benchmarks/gpu/run.sh):

* the tests that need a GPU run first (a skipif naming CUDA or a GPU, or
  "cuda" in the test's name), then the rest in collection order;
* no test starts after CPLIB_TEST_START_DEADLINE (epoch seconds): the rest
  are skipped as "left out" and pytest ends normally;
* every result is appended to CPLIB_TEST_PROGRESS (JSON lines) as it
  arrives, and the collected ids to CPLIB_TEST_PROGRESS + ".collected", so a
  run killed at its hard limit still leaves its counts and failing tests.

``python benchmarks/gpu/budget_plugin.py PROGRESS`` prints the summary: one
counts line first, then the failing tests and what was left out.
"""

from __future__ import annotations

import json
import os
import sys
import time

LEFT_OUT = "left out: the tests stage's time budget ran out"


def _deadline() -> float:
    return float(os.environ.get("CPLIB_TEST_START_DEADLINE", "0") or 0)


def needs_gpu(item) -> bool:
    for mark in item.iter_markers("skipif"):
        reason = str(mark.kwargs.get("reason", ""))
        if "CUDA" in reason or "GPU" in reason:
            return True
    return "cuda" in item.name.lower()


def _append(path: str, record: dict) -> None:
    # One write per line (O_APPEND): lines from several processes never interleave.
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def pytest_collection_modifyitems(session, config, items):
    items[:] = [it for it in items if needs_gpu(it)] + [it for it in items if not needs_gpu(it)]


def pytest_collection_finish(session):
    # The final selection (after -k / deselection), in running order.
    progress = os.environ.get("CPLIB_TEST_PROGRESS")
    worker = getattr(session.config, "workerinput", {}).get("workerid")
    if progress and worker in (None, "gw0"):  # every xdist worker collects the same
        with open(progress + ".collected", "w") as f:
            json.dump({"gpu": [it.nodeid for it in session.items if needs_gpu(it)],
                       "other": [it.nodeid for it in session.items if not needs_gpu(it)]}, f)


def pytest_runtest_setup(item):
    deadline = _deadline()
    if deadline and time.time() > deadline:
        import pytest
        pytest.skip(LEFT_OUT)


def pytest_runtest_logreport(report):
    progress = os.environ.get("CPLIB_TEST_PROGRESS")
    if not progress or os.environ.get("PYTEST_XDIST_WORKER"):
        return  # xdist workers pass their reports to the controller, which writes
    if report.when == "call" or report.outcome != "passed":
        left_out = report.skipped and LEFT_OUT in str(report.longrepr)
        _append(progress, {"id": report.nodeid, "when": report.when,
                           "outcome": "left out" if left_out else report.outcome})


def summarize(progress: str) -> list[str]:
    """The counts line, then the failing tests, then what was left out."""
    try:
        with open(progress + ".collected") as f:
            collected = json.load(f)
    except (OSError, ValueError):
        collected = {"gpu": [], "other": []}
    results: dict[str, str] = {}
    try:
        with open(progress) as f:
            for line in f:
                try:
                    r = json.loads(line)
                except ValueError:
                    continue  # a line cut by the kill
                # A failed setup/teardown counts as an error, a failed call as a failure.
                if r["outcome"] == "failed":
                    results[r["id"]] = "failed" if r["when"] == "call" else "error"
                elif r["id"] not in results or results[r["id"]] == "passed":
                    results.setdefault(r["id"], r["outcome"])
    except OSError:
        pass
    everything = collected["gpu"] + collected["other"]
    never = [t for t in everything if t not in results]
    counts = {k: sum(1 for v in results.values() if v == k)
              for k in ("passed", "failed", "error", "skipped", "left out")}
    gpu_ran = sum(1 for t in collected["gpu"] if results.get(t) in ("passed", "failed", "error"))
    lines = [f"{counts['passed']} passed, {counts['failed']} failed, {counts['error']} errors, "
             f"{counts['skipped']} skipped, {counts['left out']} left out, {len(never)} not "
             f"finished, of {len(everything)} collected ({gpu_ran} of {len(collected['gpu'])} "
             "GPU tests ran)"]
    lines += [f"FAILED {t}" for t, v in results.items() if v == "failed"]
    lines += [f"ERROR {t}" for t, v in results.items() if v == "error"]
    left = [t for t, v in results.items() if v == "left out"]
    if never:
        lines.append(f"not finished ({len(never)}, running or queued at the hard limit): "
                     + " ".join(never[:40]) + (" ..." if len(never) > 40 else ""))
    if left:
        lines.append(f"left out ({len(left)}): " + " ".join(left[:40])
                     + (" ..." if len(left) > 40 else ""))
    return lines


if __name__ == "__main__":
    print("\n".join(summarize(sys.argv[1])))
