"""The readable side of tests/support/family_report.py: the markdown table
(counts per class and switch, the causes of what is not exact
(family_causes.py), the refusals by wording, every family's row, the
times) and the report's metadata."""

from __future__ import annotations

import datetime
import re
import subprocess
from collections import Counter, defaultdict
from typing import Any

import numpy as np

from family_causes import NOTES, RULES, cause

SWITCH_NAMES = {"sdpa": "(a) region + sdpa", "cplib": "(b) region + \"cplib\"",
                "cplib_outside": "(b') \"cplib\" outside CP vs eager",
                "trainer": "(c) Trainer step on patch_torch()"}


SHORT = {"sdpa": "a", "cplib": "b", "cplib_outside": "b'", "trainer": "c"}


def meta() -> dict[str, Any]:
    """What the report ran on: versions, the checkout's commit, and the
    installed cplib (the tests run against the wheel, which another
    checkout's `make build` may have replaced since that commit)."""
    import os

    import torch
    import transformers

    import cplib

    here = os.path.dirname(os.path.abspath(__file__))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=here).stdout.strip()
    installed = datetime.datetime.fromtimestamp(os.path.getmtime(cplib.__file__))
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "transformers": transformers.__version__, "torch": torch.__version__,
            "commit": commit, "cplib": os.path.dirname(cplib.__file__),
            "cplib_installed": installed.isoformat(timespec="seconds"), "cpus": os.cpu_count()}


def _refusal(entry: dict) -> str:
    """A refusal's message with the names it gives and its numbers blurred:
    one wording, one group."""
    text = entry.get("error", "")
    for name in entry.get("named", []):
        text = text.replace(name, "<name>")
    text = re.sub(r"\d+(\.\d+)?", "N", re.sub(r" \[[^\]]*\]$", "", text))
    return f"{entry['class']} by {entry.get('by') or '?'}: {text[:150]}"


def _cell(entry: dict | None) -> str:
    if entry is None:
        return ""
    cls = entry["class"]
    if "helper_loss" in entry and cls != "not_decoder":  # its attention, apart from its loss
        return f"{cls} (own loss; attention with cplib's loss: {_cell(entry['helper_loss'])})"
    if cls.startswith("refused") and entry.get("by"):
        return f"{cls} ({entry['by']}{', build' if entry.get('stage') == 'build' else ''})"
    if cls == "wrong":
        return f"wrong (loss {entry.get('loss_err', float('nan')):.1e}, " \
               f"grad {entry.get('grad_err', float('nan')):.1e}; {entry['run']})"
    return cls


def markdown(report: dict[str, Any]) -> str:
    fams = report["families"]
    switches = [s for s in SWITCH_NAMES if any(s in f["switches"] for f in fams.values())]
    m = report["meta"]
    out = [f"# Every decoder family under each switch ({m['date']})", "",
           f"transformers {m['transformers']}, torch {m['torch']}, checkout at `{m['commit']}`, "
           f"cplib installed {m['cplib_installed']}; {report['world']} gloo ranks, "
           f"{report['seq']} tokens, fp32. Exact: the ranks' mean loss within "
           f"{report['loss_tol']:g} of one process's, relative; the ranks' mean gradients within "
           f"{report['grad_tol']:g}: max |g - g_ref| over every parameter element / max |g_ref|. "
           f"{len(fams)} families enumerated in {report['enumerate_s']}s, run in "
           f"{report['total_s']}s. Switches: " +
           "; ".join(f"{SHORT[s]}: {SWITCH_NAMES[s]}" for s in switches) + "." +
           (f" **{m['warning']}.**" if m.get("warning") else ""),
           "", "## Counts", "",
           "| class | " + " | ".join(SWITCH_NAMES[s] for s in switches) + " |",
           "| --- | " + " | ".join("---" for _ in switches) + " |"]
    counts = {s: Counter(f["switches"][s]["class"] for f in fams.values() if s in f["switches"])
              for s in switches}
    for cls in sorted({c for cs in counts.values() for c in cs}):
        out.append(f"| {cls} | " + " | ".join(str(counts[s].get(cls, 0)) for s in switches)
                   + " |")
    out += ["", "## Causes (not exact and not refused by name)", ""] + _causes(fams, switches)
    out += ["", "## Refusals, by wording", ""]
    groups: dict[str, list[str]] = defaultdict(list)
    for name, f in sorted(fams.items()):
        for s in switches:
            entry = f["switches"].get(s)
            if entry and entry["class"].startswith("refused"):
                groups[_refusal(entry)].append(f"{name} ({SHORT[s]})")
    for sig, names in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        out.append(f"- **{len(names)}** `{sig}`: {', '.join(names)}")
    out += ["", "## Every family", "",
            "| family | " + " | ".join(SWITCH_NAMES[s] for s in switches) + " | s | notes |",
            "| --- | " + " | ".join("---" for _ in switches) + " | --- | --- |"]
    for name, f in sorted(fams.items()):
        notes = [NOTES[name]] if name in NOTES else []
        notes += [f["note"]] if f.get("note") else []
        notes += [f"{SHORT[s]}: {f['switches'][s]['error'][:160]}" for s in switches
                  if s in f["switches"] and f["switches"][s]["class"] not in ("exact", "n/a")
                  and f["switches"][s].get("error")]
        out.append(f"| {name} | " + " | ".join(_cell(f["switches"].get(s)) for s in switches)
                   + f" | {f.get('wall_s', '')} | {'; '.join(notes).replace('|', '/')} |")
    out += ["", "## Times", ""] + _times(report)
    if "real_trainer" in report:
        out += ["", "## HF Trainer itself against the by-hand step", ""] + \
            [f"- {k}: {v}" for k, v in report["real_trainer"].items()]
    return "\n".join(out) + "\n"


def _causes(fams: dict, switches: list[str]) -> list[str]:
    by_cause: dict[str, list[str]] = defaultdict(list)
    for name, f in sorted(fams.items()):
        hits: dict[str, list[str]] = defaultdict(list)
        for s in switches:
            entry = f["switches"].get(s)
            found = cause(set(f.get("features", [])), s, entry) if entry else None
            if found:
                hits[found].append(SHORT[s])
        for found, where in hits.items():
            by_cause[found].append(f"{name} ({', '.join(where)})")
    order = [c for c, _ in RULES] + ["other"]
    return [f"- **{c}** ({len(by_cause[c])}): {', '.join(by_cause[c])}"
            for c in order if by_cause.get(c)]


def _times(report: dict) -> list[str]:
    walls = sorted(((f.get("wall_s") or 0.0, n) for n, f in report["families"].items()),
                   reverse=True)
    per_run: dict[str, list[float]] = defaultdict(list)
    for f in report["families"].values():
        for run, entry in f["runs"].items():
            if entry.get("seconds") is not None:
                per_run[run].append(entry["seconds"])
    lines = [f"Total {report['total_s']}s for {len(walls)} families (median "
             f"{np.median([w for w, _ in walls]):.2f}s a family, wall time of its task on both "
             "ranks); the slowest: " + ", ".join(f"{n} {w:.1f}s" for w, n in walls[:12]) + ".",
             "", "| run | median s | max s |", "| --- | --- | --- |"]
    for run, secs in sorted(per_run.items()):
        lines.append(f"| {run} | {np.median(secs):.3f} | {max(secs):.2f} |")
    return lines
