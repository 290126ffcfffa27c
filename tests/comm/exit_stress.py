"""Runs tests/support/exit_scenario.py (two gloo processes: failing calls,
destroy_process_group, interpreter exit) many times and counts the aborts at
exit, the other failures and the runs where a process group outlived
destroy_process_group() (the abort's cause; see test_exit_clean.py).

    .venv/bin/python tests/comm/exit_stress.py --runs 50 --parallel 2 [--bad-input] [--collector]

``--parallel``: pairs run at once (the abort is a race that load makes
likelier, as on a busy CI machine). cplib is imported from where this
interpreter finds it (the installed wheel under ``make build``). Exit status
1 when any run aborted or failed."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "support"))
from exit_scenario import RankResult, run_pair  # noqa: E402


def _import_root() -> str:
    import cplib

    return os.path.dirname(os.path.dirname(os.path.abspath(cplib.__file__)))


def _verdict(results: list[RankResult]) -> str:
    if any(r.aborted for r in results):
        return "abort"
    if any(r.returncode != 0 for r in results):
        return "failed"
    kept = any(line[1] != "0" or line[2] not in ("0", "-")
               for r in results for line in r.lines("destroyed"))
    return "group kept" if kept else "clean"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--bad-input", action="store_true",
                        help="also run test_bad_input's two-rank matrix before exiting")
    parser.add_argument("--collector", action="store_true",
                        help="leave the garbage collector on, as a program does (a kept group "
                             "is then seen only where the collector has not run yet)")
    args = parser.parse_args()
    root = _import_root()
    counts = {"clean": 0, "group kept": 0, "abort": 0, "failed": 0}
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as cwd, ThreadPoolExecutor(args.parallel) as pool:
        runs = [pool.submit(run_pair, root, args.rounds, args.bad_input, args.collector, cwd)
                for _ in range(args.runs)]
        for i, run in enumerate(runs):
            results = run.result()
            verdict = _verdict(results)
            counts[verdict] += 1
            if verdict in ("abort", "failed"):
                for r in results:
                    print(f"run {i} rank {r.rank}: exit {r.returncode}\n{r.err[-1500:]}")
    seconds = time.monotonic() - start
    print(f"cplib from {root}; {args.runs} runs of {args.rounds} rounds"
          f"{' + bad inputs' if args.bad_input else ''}, {args.parallel} at once, "
          f"collector {'on' if args.collector else 'off'}, "
          f"{seconds:.0f} s")
    print("| verdict | runs |\n|---|---|")
    for verdict, n in counts.items():
        print(f"| {verdict} | {n} |")
    return int(counts["abort"] + counts["failed"] > 0)


if __name__ == "__main__":
    sys.exit(main())
