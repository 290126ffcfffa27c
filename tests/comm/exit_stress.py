"""Runs tests/support/exit_scenario.py (two gloo processes: failing calls,
destroy_process_group, interpreter exit) many times and counts the aborts at
exit, the other failures and the runs where a process group outlived
destroy_process_group() (the abort's cause; see test_exit_clean.py).

    .venv/bin/python tests/comm/exit_stress.py --runs 50 --parallel 2 [--bad-input] [--collector]
    .venv/bin/python tests/comm/exit_stress.py --runs 400 --case 'conv/*' --case 'style/*'

``--parallel``: pairs run at once (the abort is a race that load makes
likelier, as on a busy CI machine). ``--case PATTERN`` (repeatable, a glob
over the two-rank case names of tests/support/bad_input.py; ``'*'`` for all):
each pair runs one case, the next pair the next matching one, on its default
group after no round (``--rounds 0`` unless given), as a program that meets
one error and exits: issue 53's sweep, one bad input per pair; the cases that
did not end clean are listed under the table. cplib is imported from where
this interpreter finds it (the installed wheel under ``make build``). Exit
status 1 when any run aborted or failed."""

from __future__ import annotations

import argparse
import fnmatch
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
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds per pair (20; 0 with --case)")
    parser.add_argument("--bad-input", action="store_true",
                        help="also run test_bad_input's two-rank matrix before exiting")
    parser.add_argument("--collector", action="store_true",
                        help="leave the garbage collector on, as a program does (a kept group "
                             "is then seen only where the collector has not run yet)")
    parser.add_argument("--case", action="append", default=[], metavar="PATTERN",
                        help="one bad-input case per pair, cycling over the two-rank cases "
                             "whose name matches (a glob; repeatable)")
    args = parser.parse_args()
    rounds = args.rounds if args.rounds is not None else 0 if args.case else 20
    cases = _matching(args.case)
    root = _import_root()
    counts = {"clean": 0, "group kept": 0, "abort": 0, "failed": 0}
    by_case: dict[str, dict[str, int]] = {}
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as cwd, ThreadPoolExecutor(args.parallel) as pool:
        plan = [cases[i % len(cases)] if cases else None for i in range(args.runs)]
        runs = [pool.submit(run_pair, root, rounds, args.bad_input, args.collector, cwd,
                            cases=[case] if case else []) for case in plan]
        for i, (case, run) in enumerate(zip(plan, runs)):
            results = run.result()
            verdict = _verdict(results)
            counts[verdict] += 1
            if case:
                by_case.setdefault(case, dict.fromkeys(counts, 0))[verdict] += 1
            if verdict in ("abort", "failed"):
                for r in results:
                    print(f"run {i}{f' ({case})' if case else ''} rank {r.rank}: exit "
                          f"{r.returncode}\n{r.err[-1500:]}", flush=True)
    seconds = time.monotonic() - start
    print(f"cplib from {root}; {args.runs} runs ({2 * args.runs} processes) of {rounds} rounds"
          f"{' + bad inputs' if args.bad_input else ''}"
          f"{f' + one of {len(cases)} cases' if cases else ''}, {args.parallel} at once, "
          f"collector {'on' if args.collector else 'off'}, {seconds:.0f} s")
    print("| verdict | runs |\n|---|---|")
    for verdict, n in counts.items():
        print(f"| {verdict} | {n} |")
    for case, per in by_case.items():
        if per["clean"] != sum(per.values()):
            print(f"{case}: " + ", ".join(f"{v} {n}" for v, n in per.items() if n))
    return int(counts["abort"] + counts["failed"] > 0)


def _matching(patterns: list[str]) -> list[str]:
    """The two-rank bad-input cases whose names match any of ``patterns``."""
    if not patterns:
        return []
    import bad_input

    names = [c[0] for c in bad_input.CASES if c[1] == 2]
    found = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    if not found:
        raise SystemExit(f"no two-rank case matches {patterns}; the cases: {', '.join(names)}")
    return found


if __name__ == "__main__":
    sys.exit(main())
