"""pytest plugin of the GPU check's tests stage (benchmarks/gpu/run.sh), which
selects the CUDA tests by their marker (``-m cuda``):

* no test starts after CPLIB_TEST_START_DEADLINE (epoch seconds): the rest
  are skipped as "left out" and pytest ends normally;
* every result is appended to CPLIB_TEST_PROGRESS (JSON lines) as it
  arrives, with a skip's reason, and the selected ids to CPLIB_TEST_PROGRESS
  + ".collected", so a run killed at its hard limit still leaves its counts
  and the names of what failed, skipped, was left out or did not finish.

``python benchmarks/gpu/budget_plugin.py PROGRESS`` prints the summary: one
counts line, then those names. ``--verdict PROGRESS`` prints PASS (every
selected test ran and passed), FAIL (one failed or errored, or none was
selected) or INCOMPLETE (one skipped, was left out or did not finish).
"""

from __future__ import annotations

import json
import os
import sys
import time

LEFT_OUT = "left out: the tests stage's time budget ran out"


def _deadline() -> float:
    return float(os.environ.get("CPLIB_TEST_START_DEADLINE", "0") or 0)


def _append(path: str, record: dict) -> None:
    # One write per line (O_APPEND): lines from several processes never interleave.
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def pytest_collection_finish(session):
    # The final selection (after -m / -k), in running order.
    progress = os.environ.get("CPLIB_TEST_PROGRESS")
    worker = getattr(session.config, "workerinput", {}).get("workerid")
    # Every xdist worker collects the same; the controller collects nothing.
    if progress and worker in (None, "gw0") and session.items:
        with open(progress + ".collected", "w") as f:
            json.dump([it.nodeid for it in session.items], f)


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
        reason = ""
        if report.skipped:
            lr = report.longrepr
            reason = str(lr[2] if isinstance(lr, tuple) and len(lr) == 3 else lr)
        outcome = "left out" if report.skipped and LEFT_OUT in reason else report.outcome
        _append(progress, {"id": report.nodeid, "when": report.when, "outcome": outcome,
                           "reason": reason[:200]})


def _results(progress: str) -> tuple[list[str], dict[str, str], dict[str, str]]:
    try:
        with open(progress + ".collected") as f:
            collected = json.load(f)
    except (OSError, ValueError):
        collected = []
    results: dict[str, str] = {}
    reasons: dict[str, str] = {}
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
                if r.get("reason"):
                    reasons[r["id"]] = r["reason"]
    except OSError:
        pass
    return collected, results, reasons


def summarize(progress: str) -> list[str]:
    """The counts line, then every test that did not pass, by kind."""
    collected, results, reasons = _results(progress)
    never = [t for t in collected if t not in results]
    counts = {k: sum(1 for v in results.values() if v == k)
              for k in ("passed", "failed", "error", "skipped", "left out")}
    lines = [f"{counts['passed']} passed, {counts['failed']} failed, {counts['error']} errors, "
             f"{counts['skipped']} skipped, {counts['left out']} left out, {len(never)} not "
             f"finished, of {len(collected)} selected"]
    lines += [f"FAILED {t}" for t, v in results.items() if v == "failed"]
    lines += [f"ERROR {t}" for t, v in results.items() if v == "error"]
    by_reason: dict[str, list[str]] = {}
    for t, v in results.items():
        if v == "skipped":
            by_reason.setdefault(reasons.get(t, ""), []).append(t)
    lines += [f"SKIPPED ({len(ids)}) {why}: " + " ".join(ids) for why, ids in by_reason.items()]
    left = [t for t, v in results.items() if v == "left out"]
    if never:
        lines.append(f"not finished ({len(never)}, running or queued at the hard limit): "
                     + " ".join(never))
    if left:
        lines.append(f"left out ({len(left)}): " + " ".join(left))
    return lines


def verdict(progress: str) -> str:
    collected, results, _ = _results(progress)
    if not collected:
        return "FAIL"
    if any(v in ("failed", "error") for v in results.values()):
        return "FAIL"
    if all(results.get(t) == "passed" for t in collected):
        return "PASS"
    return "INCOMPLETE"


if __name__ == "__main__":
    if sys.argv[1] == "--verdict":
        print(verdict(sys.argv[2]))
    else:
        print("\n".join(summarize(sys.argv[1])))
