"""Classifies what tests/support/family_runs.py's ranks saw, and the CLI that
runs every family and writes the report (issue 53, item 2)::

    python tests/support/family_report.py --report build/family_report.json \\
        [--markdown build/family_report.md] [--families llama,bloom] \\
        [--switches sdpa,cplib,cplib_outside,trainer] [--real-trainer llama,mixtral]

Classes, per run and per switch (a switch takes its worst layout):
``exact`` (the CP ranks' mean loss within ``LOSS_TOL`` of one process,
relative; the ranks' mean gradients within ``GRAD_TOL`` of one process's,
measured as max |g - g_ref| over every parameter element divided by
max |g_ref| over every element), ``refused`` (NotImplementedError or
ValueError on every rank, naming the family or one of its model/layer
classes), ``refused_unnamed`` (the same, naming none), ``wrong``,
``crash`` (anything else, or an error on some ranks only), ``build_fails``
(the model cannot be built for that switch, or the one-process reference
cannot run), ``hang`` (a rank timed out in a collective, or the task did not
finish), ``not_decoder`` (earlier outputs move when the last token changes,
or no model class takes the text config: left out of every switch), ``n/a``
(Trainer for a text model without LM head). A switch refused because the
model computes its loss itself also carries ``helper_loss``: the class of
the same runs with ``cplib.loss.cross_entropy`` on the logits (its
attention, judged apart from its loss).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from typing import Any

import numpy as np

LOSS_TOL = 2e-5
GRAD_TOL = 1e-5
CAUSAL_TOL = 1e-4  # MoE regrouping moves earlier logits by rounding, not more
ORDER = ["n/a", "exact", "refused", "refused_unnamed", "not_decoder", "wrong", "crash", "hang",
         "build_fails"]
RUNS = {"sdpa": ["sdpa/sequential", "sdpa/head_tail"],
        "cplib": ["cplib/sequential", "cplib/head_tail"],
        "cplib_outside": ["cplib_outside"], "trainer": ["trainer"]}
REFERENCE_OF = {"cplib_outside": "reference", "trainer": "reference_train"}
HELPER = "+helper_loss"  # a run again with cplib.loss.cross_entropy (family_runs.py)


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")[:240]


def _error(outcomes: list[dict]) -> str:
    bad = next(o for o in outcomes if not o["ok"])
    return f"{bad['type']}: {_first_line(bad['message'])}" + \
        (f" [{bad['where']}]" if bad.get("where") else "")


def _failed(outcomes: list[dict]) -> dict[str, Any]:
    """The class of a run some rank did not finish."""
    failed = [o for o in outcomes if not o["ok"]]
    detail = _error(outcomes)
    if any(o.get("timeout") for o in failed):
        return {"class": "hang", "error": detail}
    if len(failed) < len(outcomes):
        ranks = [r for r, o in enumerate(outcomes) if not o["ok"]]
        return {"class": "crash", "error": f"only on ranks {ranks}: {detail}"}
    types = {o["type"] for o in failed}
    if types <= {"NotImplementedError", "ValueError"} and len(types) == 1:
        named = all(o["named"] for o in failed)
        if failed[0]["stage"] == "build" and not named:
            return {"class": "build_fails", "error": detail}
        return {"class": "refused" if named else "refused_unnamed", "error": detail,
                "stage": failed[0]["stage"], "named": failed[0]["named"],
                "by": failed[0].get("by", "")}
    return {"class": "build_fails" if failed[0]["stage"] == "build" else "crash",
            "error": detail, "stack": failed[0].get("stack", [])}


def _compare(outcomes: list[dict], reference: dict) -> dict[str, Any]:
    loss = float(np.mean([o["loss"] for o in outcomes]))
    grads = np.mean([o["grads"].astype(np.float64) for o in outcomes], axis=0)
    want = reference["grads"].astype(np.float64)
    out: dict[str, Any] = {"loss_err": abs(loss - reference["loss"]) / abs(reference["loss"])}
    if grads.shape != want.shape:
        return {**out, "class": "wrong", "error": f"gradients of {grads.shape} vs {want.shape}"}
    out["grad_err"] = float(np.abs(grads - want).max() / max(np.abs(want).max(), 1e-30))
    if any(abs(o["weights"] - reference["weights"]) > 1e-9 * abs(reference["weights"]) + 1e-9
           for o in outcomes):
        return {**out, "class": "wrong", "error": "harness: other weights than the reference"}
    exact = out["loss_err"] <= LOSS_TOL and out["grad_err"] <= GRAD_TOL
    if not np.isfinite([out["loss_err"], out["grad_err"]]).all():
        exact = False
    return {**out, "class": "exact" if exact else "wrong"}


def classify(results: list[dict]) -> dict[str, Any]:
    """{run: {...}, switch: {...}} for one family from every rank's results
    (family_runs.run_part's, merged over the parts)."""
    by_run: dict[str, list[dict]] = {}
    for r in results:
        for name, outcome in r["runs"].items():
            by_run.setdefault(name, []).append(outcome)
    runs: dict[str, dict] = {}
    ref = by_run.get("reference", [None])[0]
    not_decoder = None
    if ref is not None and ref.get("causal_error", 0.0) > CAUSAL_TOL:  # probed before backward
        not_decoder = f"not causal: earlier outputs move by {ref['causal_error']:.2g} relative"
    elif ref is not None and not ref["ok"] and ref["type"] == "LookupError":
        not_decoder = f"no model class: {_first_line(ref['message'])}"
    if ref is not None and not ref["ok"]:
        base = {"class": "build_fails", "error": "reference (eager, one process): " + _error([ref])}
    for name, outcomes in by_run.items():
        if name.startswith("reference"):
            continue
        ref_name = "reference_helper" if name.endswith(HELPER) else \
            REFERENCE_OF.get(name, "reference")
        reference = by_run.get(ref_name, [None])[0]
        refused_at_build = all(not o["ok"] and o["stage"] == "build" for o in outcomes)
        if not_decoder:
            runs[name] = {"class": "not_decoder", "error": not_decoder}
        elif refused_at_build or all(not o["ok"] for o in outcomes):
            # The switch cannot be set, or the run raised on every rank: its
            # class is its failure's, whatever the reference does.
            runs[name] = _failed(outcomes)
        elif ref is not None and not ref["ok"]:  # nothing to hold the run to
            runs[name] = dict(base)
            if not all(o["ok"] for o in outcomes):
                runs[name]["error"] += f"; the run: {_error(outcomes)}"
        elif reference is None or not reference["ok"]:  # this run's own reference
            runs[name] = {"class": "build_fails",
                          "error": f"{ref_name}: " + (_error([reference]) if reference else "none")}
            if not all(o["ok"] for o in outcomes):
                runs[name]["error"] += f"; the run: {_error(outcomes)}"
        elif not all(o["ok"] for o in outcomes):
            runs[name] = _failed(outcomes)
        else:
            runs[name] = _compare(outcomes, reference)
        runs[name]["seconds"] = max(o["seconds"] for o in outcomes)
    switches = {}
    skipped = {k: v for r in results for k, v in r.get("skipped", {}).items()}
    for switch, names in RUNS.items():
        got = [(n, runs[n]) for n in names if n in runs]
        if got:
            name, worst = max(got, key=lambda nr: ORDER.index(nr[1]["class"]))
            switches[switch] = {**worst, "run": name}
            helper = [(n + HELPER, runs[n + HELPER]) for n in names if n + HELPER in runs]
            if helper:
                name, worst = max(helper, key=lambda nr: ORDER.index(nr[1]["class"]))
                switches[switch]["helper_loss"] = {**worst, "run": name}
        elif switch in skipped:
            switches[switch] = {"class": "n/a", "error": skipped[switch]}
    features = ref.get("features", []) if ref is not None else []
    return {"runs": runs, "switches": switches, "features": features,
            "seconds": max(r["seconds"] for r in results)}


def _merge(parts: list[list[dict]]) -> list[dict]:
    """One result per rank from the results of every part (task) of a family."""
    merged = []
    for rank_results in zip(*parts):
        runs, skipped = {}, {}
        for r in rank_results:
            runs.update(r["runs"])
            skipped.update(r.get("skipped", {}))
        merged.append({"runs": runs, "skipped": skipped,
                       "seconds": round(sum(r["seconds"] for r in rank_results), 3)})
    return merged


def _hang_stacks(pool) -> str:
    """Where each rank of a pool whose task did not finish was waiting: the
    innermost frames of cplib, transformers or accelerate in its dump."""
    import family_runs

    out = []
    for rank, proc in enumerate(pool._procs):
        try:
            with open(family_runs.hang_dump_path(proc.pid), encoding="utf-8") as fh:
                frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', fh.read())
        except OSError:
            continue
        owned = [f"{family_runs.owned_path(path)}:{line} {name}" for path, line, name in frames
                 if any(k in path for k in ("/cplib/", "/transformers/", "/accelerate/"))]
        if owned:
            out.append(f"rank {rank} waits in {' < '.join(owned[:3])}")
    return "; ".join(out)


def _classify_family(pool_box: list, family: str, switches: tuple[str, ...], world: int,
                     layouts: tuple[str, ...] | None = None) -> dict:
    """Every part of ``family`` on the pool in ``pool_box`` (replaced by a
    fresh pool after a part that did not finish, which is then ``hang``);
    the regions in ``layouts`` (None: every layout)."""
    import family_runs

    parts, hung, helper, note = [], {}, False, None
    for part in family_runs.PARTS:
        if part != "one_process" and part not in switches:
            continue
        try:
            parts.append(pool_box[0].run(family_runs.run_part, family, part, switches, helper,
                                         layouts))
        except AssertionError as exc:  # the pool closed itself
            lines = [line for line in str(exc).splitlines() if line.strip()]
            hung[part] = f"{lines[0][:200]}; {_hang_stacks(pool_box[0])}"
            pool_box[0] = _warm_pool(world)
            continue
        ref = parts[0][0]["runs"].get("reference") if part == "one_process" else None
        if ref is not None and not ref["ok"] and ref["stage"] == "run" and \
                ref.get("causal_error", 1.0) <= CAUSAL_TOL:
            # Its own labels= loss fails in one process (transformers'
            # business): judge its attention with cplib.loss.cross_entropy.
            helper, note = True, "every run with cplib.loss.cross_entropy: its labels= loss " \
                f"fails in one process ({_error([ref])})"
            parts[0] = pool_box[0].run(family_runs.run_part, family, part, switches, helper,
                                       layouts)
    out = classify(_merge(parts)) if parts else {"runs": {}, "switches": {}, "features": [],
                                                 "seconds": None}
    if note:
        out["note"] = note
    for part, detail in hung.items():
        for switch in (switches if part == "one_process" else (part,)):
            out["switches"][switch] = {"class": "hang", "error": f"{part} task: {detail}",
                                       "run": part}
    return out


def _warm(family: str) -> bool:
    """Imports and builds once (tens of seconds on a loaded machine), so that
    the per-task timeout measures the families, not the imports."""
    import cplib.hf  # noqa: F401

    import family_cases

    family_cases.tiny_model(family, "cplib")
    return True


def _warm_pool(world: int):
    """A fresh pool of ``world`` ranks, past its imports."""
    import harness

    pool = harness.RankPool(world, timeout_s=600)
    limit, harness.RUN_TIMEOUT_S = harness.RUN_TIMEOUT_S, 900
    try:
        pool.run(_warm, "llama")
    finally:
        harness.RUN_TIMEOUT_S = limit
    return pool


def run_all(families: list[str], switches: tuple[str, ...], world: int = 2,
            progress=print) -> dict[str, Any]:
    """Every family on one pool of ``world`` ranks (a fresh pool after a
    task that did not finish)."""
    import harness

    harness.RUN_TIMEOUT_S = float(os.environ.get("CPLIB_FAMILY_TASK_TIMEOUT", "60"))
    start = time.perf_counter()
    pool_box, out = [_warm_pool(world)], {}
    warm_s = time.perf_counter() - start
    for i, family in enumerate(families):
        t = time.perf_counter()
        out[family] = _classify_family(pool_box, family, switches, world)
        out[family]["wall_s"] = round(time.perf_counter() - t, 3)
        progress(f"[{i + 1}/{len(families)}] {family} {out[family]['wall_s']}s " +
                 " ".join(f"{s}={v['class']}" for s, v in out[family]["switches"].items()))
    pool_box[0].close()
    return {"families": out, "total_s": round(time.perf_counter() - start, 1),
            "warm_s": round(warm_s, 1)}


def main(argv: list[str] | None = None) -> int:
    import family_cases
    import family_table
    import family_trainer

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--report", required=True, help="JSON output")
    p.add_argument("--markdown", help="a readable table (default: the report's name, .md)")
    p.add_argument("--families", help="comma-separated (default: every family)")
    p.add_argument("--switches", default=",".join(RUNS))
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--real-trainer", default="",
                   help="families to run through HF Trainer itself, against the by-hand form")
    args = p.parse_args(argv)
    t = time.perf_counter()
    before = family_table.meta()
    families = args.families.split(",") if args.families else family_cases.families()
    enumerate_s = time.perf_counter() - t
    report = run_all(families, tuple(args.switches.split(",")), args.world)
    report.update(enumerate_s=round(enumerate_s, 1), world=args.world, seq=family_cases.SEQ,
                  loss_tol=LOSS_TOL, grad_tol=GRAD_TOL, meta=before)
    if family_table.meta()["cplib_installed"] != before["cplib_installed"]:
        # A rank pool started after the reinstall ran the new wheel.
        report["meta"]["warning"] = "cplib was reinstalled while the report ran"
    if args.real_trainer:
        report["real_trainer"] = family_trainer.real_trainer(args.real_trainer.split(","),
                                                           args.world)
    with open(args.report, "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=1, sort_keys=True)
    markdown = args.markdown or os.path.splitext(args.report)[0] + ".md"
    with open(markdown, "w", encoding="utf-8") as fh:
        fh.write(family_table.markdown(report))
    print(f"{len(families)} families in {report['total_s']}s: {args.report}, {markdown}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
