"""The GPU check end to end on this machine (no GPU): `make gpu-check` in a copy
of the tree without .git (as the GPU machine gets it), with a prepared folder
made from the CPU wheel, then without one; the benchmark's cells under their
time limits; every test that skips without a GPU carries the `cuda` marker.

Checked: at most 8 files come back, flat; the commit is recorded (the
prepared wheel's, or "unknown" with the reason); the stages run in order;
the tests stage runs exactly the tests `pytest -m cuda` selects; the verdict
is not PASS and the exit status not 0 when the GPU stages could not run; a
stale wheel (sources changed after `make gpu-prep`) fails the install."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tarfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STAGES = ["install", "tests", "bench", "memcheck", "demo"]


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout


def _tree_copy(dest: str) -> str:
    """The files the device tool sends (tracked, and untracked but not
    ignored), without .git."""
    files = _git("ls-files", "--cached", "--others", "--exclude-standard", "-z").split("\0")
    for rel in filter(None, files):
        src = os.path.join(REPO, rel)
        if os.path.isfile(src):
            os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
            shutil.copy2(src, os.path.join(dest, rel))
    return dest


def _cpu_wheel() -> str:
    wheels = glob.glob(os.path.join(REPO, "dist", "cplib-*-abi3-*.whl"))
    if not wheels:
        pytest.skip("no CPU wheel in dist/ (make build makes one; `make test` always has it)")
    return wheels[0]


def _env(tmp_path, **extra) -> dict:
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path / "out"),
               GPU_CHECK_TEST_WORKERS="0", **extra)
    env.pop("PYTHONPATH", None)
    env.pop("CPLIB_GPU_TESTS_ON_CPU", None)  # the check's tests must skip, as without a GPU
    return env


@pytest.fixture(scope="module")
def collected(tmp_path_factory) -> dict[str, list[str]]:
    """One collection of the suite: the tests `-m cuda` selects, and those
    that skip for want of a GPU without carrying the marker."""
    tmp = tmp_path_factory.mktemp("collect")
    plugin = tmp / "audit_plugin.py"
    plugin.write_text(
        "import json\n"
        "def _needs_gpu(it):\n"
        "    reasons = [str(m.kwargs.get('reason', '')) for m in it.iter_markers('skipif')]\n"
        "    return any('GPU' in r for r in reasons)\n"
        "def pytest_collection_finish(session):\n"
        "    marked = [it.nodeid for it in session.items if it.get_closest_marker('cuda')]\n"
        "    bad = [it.nodeid for it in session.items\n"
        "           if it.get_closest_marker('cuda') is None and _needs_gpu(it)]\n"
        f"    json.dump(dict(cuda=marked, unmarked=bad), open({str(tmp / 'found.json')!r}, 'w'))\n")
    env = dict(os.environ, PYTHONPATH=str(tmp))
    subprocess.run([sys.executable, "-P", "-m", "pytest", "--collect-only", "-q", "-p",
                    "audit_plugin", "-p", "no:cacheprovider", os.path.join(REPO, "tests")],
                   cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    return json.loads((tmp / "found.json").read_text())


def _summary_stages(text: str) -> list[tuple[str, str]]:
    rows = []
    for line in text.splitlines():
        words = line.split()
        if words and words[0] in STAGES:
            rows.append((words[0], words[1]))
    return rows


def test_make_gpu_check_end_to_end_without_a_gpu(tmp_path, collected):
    wheel = _cpu_wheel()
    tree = _tree_copy(str(tmp_path / "tree"))
    assert not os.path.exists(os.path.join(tree, ".git"))
    prep = subprocess.run([sys.executable, os.path.join(REPO, "build_support", "gpu_prep.py"),
                           "write", wheel, os.path.join(tree, ".gpu-prep")],
                          capture_output=True, text=True, check=True).stdout
    head = _git("rev-parse", "HEAD").strip()
    assert head in prep, prep
    run = subprocess.run(["make", "-s", "gpu-check"], cwd=tree, env=_env(tmp_path),
                         capture_output=True, text=True, timeout=500)
    out = tmp_path / "out"
    files = sorted(os.listdir(out))
    log = run.stdout + run.stderr
    assert run.returncode == 2, log  # INCOMPLETE: the GPU stages could not run
    assert len(files) <= 8 and all((out / f).is_file() for f in files), files
    assert set(files) == {"summary.txt", "tests_summary.txt", "gpu-check-files.tar.gz"}, files
    summary = (out / "summary.txt").read_text()
    assert summary.startswith("=== GPU check: INCOMPLETE"), summary
    assert f"commit: {head}" in summary, summary
    assert f"files in the output folder: {len(files)}" in summary, summary
    assert _summary_stages(summary) == [
        ("install", "PASS"), ("tests", "INCOMPLETE"), ("bench", "SKIP"), ("memcheck", "SKIP"),
        ("demo", "SKIP")], summary
    assert summary.index("install") < summary.index("\ntests") < summary.index("\nbench")
    # the tests stage ran exactly the tests the marker selects (all skipped here)
    tests = (out / "tests_summary.txt").read_text().splitlines()
    assert head in tests[0] and "pytest -m cuda" in tests[0], tests[0]
    selected = len(collected["cuda"])
    assert selected > 0
    assert tests[1] == (f"0 passed, 0 failed, 0 errors, {selected} skipped, 0 left out, 0 not "
                        f"finished, of {selected} selected"), tests[1]
    assert "not PASS because:" in summary and "no CUDA GPU visible" in summary
    with tarfile.open(out / "gpu-check-files.tar.gz") as tar:
        names = {os.path.basename(n) for n in tar.getnames()}
    assert {"env.txt", "install.log", "tests.log", "junit.xml"} <= names, names
    install = tarfile.open(out / "gpu-check-files.tar.gz").extractfile("./install.log").read()
    assert b"the wheel's extension, sha256" in install, install
    assert b"the sources here are the wheel's" in install, install


def test_no_wheel_records_an_unknown_commit_and_a_stale_wheel_fails(tmp_path):
    tree = _tree_copy(str(tmp_path / "tree"))
    run_sh = os.path.join(tree, "benchmarks", "gpu", "run.sh")
    run = subprocess.run([run_sh, "--stages", "install"], cwd=tree,
                         env=_env(tmp_path, GPU_CHECK_SKIP_BUILD="1"), capture_output=True,
                         text=True, timeout=300)
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert run.returncode == 2, run.stdout + run.stderr
    assert "commit: unknown (no prepared wheel carried" in summary, summary
    assert _summary_stages(summary) == [("install", "SKIP")], summary
    # A wheel whose sources changed afterwards is refused.
    subprocess.run([sys.executable, os.path.join(REPO, "build_support", "gpu_prep.py"), "write",
                    _cpu_wheel(), os.path.join(tree, ".gpu-prep")], check=True,
                   capture_output=True)
    with open(os.path.join(tree, "cplib", "__init__.py"), "a") as f:
        f.write("\n# changed after the wheel was built\n")
    run = subprocess.run([run_sh, "--stages", "install"], cwd=tree, env=_env(tmp_path),
                         capture_output=True, text=True, timeout=300)
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert run.returncode == 1, run.stdout + run.stderr
    assert _summary_stages(summary) == [("install", "FAIL")], summary
    assert "not those the wheel was built from" in summary, summary


def test_bench_cells_time_out_alone_and_the_json_grows_row_by_row(tmp_path):
    """A cell that hangs costs that cell only; the JSON names it; the
    verdict the GPU check reads is FAIL."""
    hung = "S=128 N=2 causal cplib flash/alltoall"
    env = dict(os.environ, CPLIB_BENCH_HANG_CELL=hung)
    env.pop("PYTHONPATH", None)
    run = subprocess.run([sys.executable, "-P", os.path.join(REPO, "benchmarks",
                                                             "bench_ring_gpu.py"),
                          "--device", "cpu", "--seqs", "128", "--worlds", "2", "--heads", "2",
                          "--head-dim", "16", "--warmup", "0", "--iters", "1", "--no-torch",
                          "--cell-timeout", "6", "--out", str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    payload = json.loads((tmp_path / "bench_ring_gpu.json").read_text())
    assert payload["complete"] and payload["cells_done"] == payload["cells"] == 9
    cplib = {(r["causal"], k): v for r in payload["rows"] for k, v in r["cplib_ms"].items()}
    assert str(cplib.pop((True, "flash/alltoall"))).startswith("error: timed out")
    assert all(isinstance(v, float) for v in cplib.values()), cplib
    assert payload["problems"]["cplib"] == [
        f"S=128 N=2 causal 2/2 cplib flash/alltoall: {payload['rows'][0]['cplib_ms']['flash/alltoall']}"]
    sys.path.insert(0, os.path.join(REPO, "benchmarks", "gpu"))
    try:
        import ring_report
    finally:
        sys.path.pop(0)
    verdict = "\n".join(ring_report.verdict(str(tmp_path / "bench_ring_gpu.json")))
    assert verdict.startswith("FAIL: 9 of 9 cells; 1 cplib cells"), verdict
    assert "timed out" in verdict
    assert "cell 9/9" in run.stdout, run.stdout


def test_every_test_that_needs_a_gpu_carries_the_cuda_marker(collected):
    """A test that skips for want of a GPU but lacks the marker would never
    run in the GPU check."""
    assert collected["cuda"] and collected["unmarked"] == []
