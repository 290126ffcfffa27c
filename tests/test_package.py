"""Package structure: no module of cplib imports one that imports it back."""

from __future__ import annotations

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _import_cycles_module():
    # By path: the repository root must not go on sys.path (it would shadow
    # an installed cplib for the tests that follow).
    spec = importlib.util.spec_from_file_location(
        "import_cycles", os.path.join(ROOT, "build_support", "import_cycles.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_no_import_cycles():
    ic = _import_cycles_module()
    graph = ic.import_graph(os.path.join(ROOT, "cplib"), "cplib")
    assert "cplib.ring.op" in graph and graph["cplib.ring.op"], "the import graph came out empty"
    assert ic.cycles(graph) == []


def test_cycle_finder_finds_a_cycle():
    ic = _import_cycles_module()
    graph = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}}
    assert ic.cycles(graph) == [["p.a", "p.b", "p.c"]]
