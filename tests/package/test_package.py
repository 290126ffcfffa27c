"""Package structure: no module of cplib imports one that imports it back,
every import runs down README.md's layer list, and the layout rules of
build_support/layout_check.py hold (module and function sizes, one cplib/
folder or a word in README.md for each csrc/torch/ folder, one docs/ page for
each cplib/ folder, tests/ mirroring the package)."""

from __future__ import annotations

import os

from build_support_modules import build_support_module as _build_support_module

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _import_cycles_module():
    return _build_support_module("import_cycles")


def test_no_import_cycles():
    ic = _import_cycles_module()
    graph = ic.import_graph(os.path.join(ROOT, "cplib"), "cplib")
    assert "cplib.ring.op" in graph and graph["cplib.ring.op"], "the import graph came out empty"
    assert ic.cycles(graph) == []


def test_cycle_finder_finds_a_cycle():
    ic = _import_cycles_module()
    graph = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}}
    assert ic.cycles(graph) == [["p.a", "p.b", "p.c"]]


def test_imports_run_down_the_layer_list():
    ic = _import_cycles_module()
    graph = ic.import_graph(os.path.join(ROOT, "cplib"), "cplib")
    layers = ic.layer_order(os.path.join(ROOT, "README.md"))
    line = {name: i for i, names in enumerate(layers) for name in names}
    # The shared layer sits under every attention feature, the front end above them.
    for feature in ("ring", "ulysses", "flex", "conv", "decode", "strategy"):
        assert line["frontend"] < line[feature] < line["attention"] < line["comm"], feature
    assert ic.layer_problems(graph, "cplib", layers) == []


def _write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_layer_checker_catches_upward_imports(tmp_path):
    """A synthetic package whose low folder imports its top folder in every
    form (function-local too), plus an import across one line and a folder
    the list does not place: each is reported, the downward import is not."""
    ic = _import_cycles_module()
    _write(tmp_path / "README.md", "p/   the layers (arrows run down this list, never up):\n"
           "  top/           the top\n"
           "  mid/, side/    two folders on one line\n"
           "                 (a continuation line)\n"
           "  low/           the bottom\n"
           "docs/            not a layer\n")
    pkg = tmp_path / "p"
    for folder in ("top", "mid", "side", "low", "stray"):
        _write(pkg / folder / "__init__.py", "")
    _write(pkg / "__init__.py", "from .top import a\n")
    _write(pkg / "top" / "a.py", "from ..low import b\n")            # down: fine
    _write(pkg / "low" / "b.py", "def f():\n    from ..top.a import g\n    return g\n")
    _write(pkg / "low" / "c.py", "def f():\n    from ..mid import m\n    return m\n")
    _write(pkg / "low" / "d.py", "def f():\n    import p.top.a\n    return p.top.a\n")
    _write(pkg / "mid" / "m.py", "from ..side import s\nfrom ..low import b\n")
    _write(pkg / "side" / "s.py", "")
    graph = ic.import_graph(str(pkg), "p")
    layers = ic.layer_order(str(tmp_path / "README.md"))
    assert layers == [["top"], ["mid", "side"], ["low"]]
    assert ic.layer_problems(graph, "p", layers) == [
        "p/stray is not in README.md's layer list: place it",
        "import runs up the layer list: p.low.b -> p.top.a",
        "import runs up the layer list: p.low.c -> p.mid, p.mid.m",
        "import runs up the layer list: p.low.d -> p.top.a",
        "import across one line of the layer list: p.mid.m -> p.side, p.side.s",
    ]


def test_layout_rules_hold():
    lc = _build_support_module("layout_check")
    assert lc.size_problems(ROOT) == []
    assert lc.mirror_problems(ROOT) == []
    assert lc.docs_problems(ROOT) == []
    assert lc.link_problems(ROOT) == []
    assert lc.tests_problems(ROOT) == []


def test_test_rules_find_each_problem(tmp_path):
    """A test file over 400 lines, a folder that is no package's, a GPU test
    outside its feature's folder: each named; a feature's GPU test is not."""
    lc = _build_support_module("layout_check")
    for folder in ("cplib/ring", "tests/ring", "tests/gpu", "tests/misc"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "cplib/ring/__init__.py").write_text("")
    (tmp_path / "tests/ring/test_long.py").write_text("x = 1\n" * 401)
    gpu = "from gpu_cases import GPU_MARKS\npytestmark = GPU_MARKS\n"
    (tmp_path / "tests/ring/test_gpu_ring.py").write_text(gpu)
    (tmp_path / "tests/gpu/test_gpu_ring.py").write_text(gpu)
    assert lc.tests_problems(str(tmp_path)) == [
        "tests/ring/test_long.py: 401 lines (at most 400)",
        "tests/misc/ is no cplib/ package's name (tests mirror the package) nor one of "
        "['gpu', 'package', 'support']",
        "tests/gpu/test_gpu_ring.py: a GPU test outside a feature's folder (put it in "
        "tests/<feature>/ beside that feature's other tests)",
    ]


def test_anchors_are_githubs():
    lc = _build_support_module("layout_check")
    assert lc.anchor("Ring attention on CPU (`cplib.ring_sdpa`)") == \
        "ring-attention-on-cpu-cplibring_sdpa"
    assert lc.anchor("Peak memory (N=4, fwd+bwd)") == "peak-memory-n4-fwdbwd"


def test_function_lengths_leave_out_the_docstring():
    lc = _build_support_module("layout_check")
    body = "\n".join(f"    x{i} = {i}" for i in range(3))
    source = (f'def f():\n    """one\n    two"""\n{body}\n\n'
              'class C:\n    def g(self):\n        pass\n')
    assert lc.function_lengths(source) == [("f", 1, 4), ("C.g", 9, 2)]


def test_native_layout_rules_hold():
    """csrc/: no file over 400 lines, no function over 80, and no lower layer
    (common/, comm/, merge/, attention/) includes a folder above it."""
    lc = _build_support_module("layout_check")
    assert len(lc.native_files(ROOT)) > 50, "csrc/'s files were not found"
    assert lc.native_problems(ROOT) == []
