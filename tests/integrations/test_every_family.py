"""Every decoder family of the pinned transformers, exact or refused by name,
under each switch users have (issue 53, item 2; DESIGN.md section 15).

The families are enumerated from transformers itself (tests/support/
family_cases.py: every causal-LM model type, and the text model of every
multimodal config): 243 candidates of transformers 5.23. Each is built tiny
and run on 2 gloo ranks against one eager process (family_runs.py,
family_report.py): (a) a ``cplib.context_parallel`` region on ``"sdpa"``,
(b) on ``"cplib"``, in one of the two layouts (alternating over the
families); (b') ``"cplib"`` outside context
parallelism; (c) HF Trainer's step on ``cplib.patch_torch()`` (by hand:
accelerate's hooks, Trainer's buffers and loss scaling). Exact: the ranks'
mean loss within 2e-5 relative of one process's, their mean gradients within
1e-5 (max |g - g_ref| over max |g_ref|).

Each outcome must be what cplib's classification says
(cplib/integrations/transformers/family_verdicts.py): where a family is
refused, the run raises NotImplementedError or ValueError naming the family
or one of its classes, on every rank; where it is exact, the run is exact,
or refused by name by another guard (transformers' own, accelerate's, or one
of cplib's for that input). Nothing wrong, crashed or hung; a family the
classification does not list fails the first test, so a new transformers
release cannot add a silent path.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

import family_cases as fc
from family_steps import LAYOUTS

pytest.importorskip("accelerate", reason="requirements/clients.txt (make build installs it)")

PARTS = 6  # the families, cut in this many tests (each a few tens of seconds)
SWITCHES = ("sdpa", "cplib", "cplib_outside", "trainer")
# Each switch and the verdict slot that decides it (Trainer runs SDPA).
SLOT = {"sdpa": "sdpa", "cplib": "cplib", "cplib_outside": "settable", "trainer": "sdpa"}


def _package(family: str) -> str:
    """The transformers.models package the family's model class lives in."""
    try:
        module = fc.model_class(family).__module__
    except LookupError:  # no model class takes its text config
        module = fc._catalog()[family][0].__module__
    return module.split(".")[2]


def test_every_family_is_classified():
    from cplib.integrations.transformers.family_verdicts import FAMILIES

    packages = {_package(f) for f in fc.families()}
    assert len(packages) > 200, len(packages)
    unclassified = sorted(packages - FAMILIES.keys())
    assert not unclassified, f"families cplib has not classified: {unclassified}"
    import transformers

    root = os.path.dirname(transformers.__file__)
    stale = sorted(f for f in FAMILIES
                   if importlib.util.find_spec(f"transformers.models.{f}") is None)
    assert not stale, f"classified, but not in transformers {transformers.__version__} " \
                      f"({root}): {stale}"


def _judge(family: str, result: dict) -> list[str]:
    """What in ``result`` (family_report.classify's) breaks the verdict."""
    from cplib.integrations.transformers.family_verdicts import FAMILIES, NOT_A_DECODER, UNTESTED

    verdict = FAMILIES[_package(family)]
    problems = []
    for switch, entry in result["switches"].items():
        refusal = getattr(verdict, SLOT[switch])
        cls = entry["class"]
        if cls == "n/a" or (cls == "not_decoder" and verdict.sdpa is NOT_A_DECODER):
            continue  # no such run (Trainer without LM head); found not causal: refused
        allowed = ("refused",) if refusal is not None else ("exact", "refused")
        if refusal is UNTESTED:  # it cannot be built here: refused wherever it can be
            allowed += ("build_fails",)
        if cls not in allowed:
            problems.append(f"{family} ({switch}): {cls}, expected one of {allowed}: "
                            f"{entry.get('error', '')[:300]} (loss {entry.get('loss_err')}, "
                            f"grad {entry.get('grad_err')})")
    return problems


@pytest.mark.parametrize("part", range(PARTS))
def test_every_family_is_exact_or_refused_by_name(ranks, part):
    import harness
    from family_report import _classify_family

    families = fc.families()[part::PARTS]
    layouts = list(LAYOUTS)
    pool_box = [ranks(2)]
    limit, harness.RUN_TIMEOUT_S = harness.RUN_TIMEOUT_S, 120  # a hung family: a failure
    try:
        problems = []
        for i, family in enumerate(families):
            # One layout a family, alternating (both are every family's in
            # family_report.py's full run; the layouts themselves are pinned
            # by tests/frontend and tests/hf): half the region runs.
            layout = layouts[(i + part) % len(layouts)]
            problems += _judge(family, _classify_family(pool_box, family, SWITCHES, 2, (layout,)))
    finally:
        harness.RUN_TIMEOUT_S = limit
        if pool_box[0] is not ranks(2):  # a hang replaced the pool: close the fresh one
            pool_box[0].close(force=True)
    assert not problems, "\n".join(problems)
