"""The GPU check end to end on this machine (no GPU): `bash
benchmarks/gpu/run.sh` (the device call) in a copy of the tree without .git
(as the GPU machine gets it), with a prepared folder made from the CPU wheel,
then without one; the benchmark's cells under their time limits; every test
that skips without a GPU carries the `cuda` marker; faked failures of each
step (GPU_CHECK_FAKE_<STEP>) never read PASS.

Checked: at most 8 files come back, flat; the commit is recorded (the
prepared wheel's, or "unknown" with the reason); the stages run in order;
the tests stage runs exactly the tests `pytest -m "cuda and not
cuda_compile"` selects (the compile stage the rest of `-m cuda`); the verdict
is not PASS and the exit status not 0 when the GPU stages could not run; a
stale wheel (sources changed after `make gpu-prep`) fails the install; a
benchmark that exits 1 after its JSON is complete, a NaN merge cell, a
memcheck log without its ERROR SUMMARY line, a stage out of time (whose
command left a process in a session of its own) and a probe that hangs each
give FAIL or INCOMPLETE, and the escaped process is ended."""

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
RUN_SH = os.path.join("benchmarks", "gpu", "run.sh")
STAGES = ["probe", "install", "tests", "bench", "memcheck", "demo", "compile"]


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
        "    compile = [it.nodeid for it in session.items\n"
        "               if it.get_closest_marker('cuda_compile')]\n"
        "    bad = [it.nodeid for it in session.items\n"
        "           if it.get_closest_marker('cuda') is None and _needs_gpu(it)]\n"
        "    found = dict(cuda=marked, compile=compile, unmarked=bad)\n"
        f"    json.dump(found, open({str(tmp / 'found.json')!r}, 'w'))\n")
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


def test_gpu_check_end_to_end_without_a_gpu(tmp_path, collected):
    wheel = _cpu_wheel()
    tree = _tree_copy(str(tmp_path / "tree"))
    assert not os.path.exists(os.path.join(tree, ".git"))
    prep = subprocess.run([sys.executable, os.path.join(REPO, "build_support", "gpu_prep.py"),
                           "write", wheel, os.path.join(tree, ".gpu-prep")],
                          capture_output=True, text=True, check=True).stdout
    head = _git("rev-parse", "HEAD").strip()
    assert head in prep, prep
    run = subprocess.run(["bash", RUN_SH], cwd=tree, env=_env(tmp_path),
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
        ("demo", "SKIP"), ("compile", "SKIP")], summary
    assert summary.index("install") < summary.index("\ntests") < summary.index("\nbench")
    # the tests stage ran exactly the tests the markers select (all skipped
    # here); the compile stage's are cuda tests too, so -m cuda is both stages'
    tests = (out / "tests_summary.txt").read_text().splitlines()
    assert head in tests[0] and "pytest -m 'cuda and not cuda_compile'" in tests[0], tests[0]
    assert collected["compile"] and set(collected["compile"]) <= set(collected["cuda"])
    selected = len(collected["cuda"]) - len(collected["compile"])
    assert selected > 0
    assert tests[1] == (f"0 passed, 0 failed, 0 errors, {selected} skipped, 0 left out, 0 not "
                        f"finished, of {selected} selected"), tests[1]
    assert "not PASS because:" in summary and "no CUDA GPU visible" in summary
    with tarfile.open(out / "gpu-check-files.tar.gz") as tar:
        names = {os.path.basename(n) for n in tar.getnames()}
    assert {"env.txt", "install.log", "tests.log", "tests-junit.xml"} <= names, names
    install = tarfile.open(out / "gpu-check-files.tar.gz").extractfile("./install.log").read()
    assert b"the wheel's extension, sha256" in install, install
    assert b"the sources here are the wheel's" in install, install


def test_no_wheel_records_an_unknown_commit_and_a_stale_wheel_fails(tmp_path):
    tree = _tree_copy(str(tmp_path / "tree"))
    run_sh = os.path.join(tree, RUN_SH)
    run = subprocess.run(["bash", run_sh, "--stages", "install"], cwd=tree,
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
    run = subprocess.run(["bash", run_sh, "--stages", "install"], cwd=tree, env=_env(tmp_path),
                         capture_output=True, text=True, timeout=300)
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert run.returncode == 1, run.stdout + run.stderr
    assert _summary_stages(summary) == [("install", "FAIL")], summary
    assert "not those the wheel was built from" in summary, summary


def test_bench_cells_time_out_alone_and_the_json_grows_row_by_row(tmp_path):
    """A cell that hangs costs that cell only (its worker is ended, none is
    left running); the JSON names it; the verdict the GPU check reads is
    FAIL."""
    hung = "S=128 N=2 causal cplib flash/alltoall"
    token = f"bench-cells-{os.getpid()}-{id(tmp_path)}"
    env = dict(os.environ, CPLIB_BENCH_HANG_CELL=hung, GPU_CHECK_STAGE=token)
    env.pop("PYTHONPATH", None)
    run = subprocess.run([sys.executable, "-P", os.path.join(REPO, "benchmarks",
                                                             "bench_ring_gpu.py"),
                          "--device", "cpu", "--seqs", "128", "--worlds", "2", "--heads", "2",
                          "--head-dim", "16", "--warmup", "0", "--iters", "1", "--no-torch",
                          "--cell-timeout", "6", "--out", str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    payload = json.loads((tmp_path / "bench_ring_gpu.json").read_text())
    assert payload["complete"] and payload["cells_done"] == payload["cells"] == 13
    cplib = {(r["causal"], k): v for r in payload["rows"] for k, v in r["cplib_ms"].items()}
    assert str(cplib.pop((True, "flash/alltoall"))).startswith("error: timed out")
    assert all(isinstance(v, float) for v in cplib.values()), cplib
    assert payload["problems"]["cplib"] == [
        "S=128 N=2 causal 2/2 cplib flash/alltoall: "
        f"{payload['rows'][0]['cplib_ms']['flash/alltoall']}"]
    sys.path.insert(0, os.path.join(REPO, "benchmarks", "gpu"))
    try:
        import reap
        import ring_report
    finally:
        sys.path.pop(0)
    assert reap.carrying(token) == [], "a cell worker outlived the benchmark"
    verdict = "\n".join(ring_report.verdict(str(tmp_path / "bench_ring_gpu.json")))
    assert verdict.startswith("FAIL: 13 of 13 cells; 1 cplib cells"), verdict
    assert "timed out" in verdict
    assert "cell 13/13" in run.stdout, run.stdout


def test_every_test_that_needs_a_gpu_carries_the_cuda_marker(collected):
    """A test that skips for want of a GPU but lacks the marker would never
    run in the GPU check."""
    assert collected["cuda"] and collected["unmarked"] == []


# ---------------------------------------------------------------- faked failures

# A benchmark that writes a complete JSON (every cell a finite figure, or a
# NaN merge cell) and exits with the status asked for.
FAKE_BENCH = """
import json, os, sys
mode = sys.argv[1]
row = dict(s=128, n=2, causal=True, hq=2, hkv=2, full_ms={"flash": 1.0},
           cplib_ms={"flash/p2p": 1.2}, torch_ms={"flash/alltoall": 1.5})
merge = dict(shape="1x4x256x16", block_dtype="float32", bytes=4096, merge_gbps=10.0,
             copy_gbps=12.0, ratio=float("nan") if mode == "nan" else 0.83)
with open(os.path.join(os.environ["CPLIB_BENCH_OUT"], "bench_ring_gpu.json"), "w") as f:
    json.dump(dict(rows=[row], merge=[merge], cells=4, cells_done=4, complete=True,
                   goals=[]), f)
sys.exit(1 if mode == "exit1" else 0)
"""
FAKE_GPU = 'printf "fake GPU | torch fake\\n1\\n"'  # the probe's first two lines
MEMCHECK_OK = 'echo "1 passed in 0.1s"; echo "========= ERROR SUMMARY: 0 errors"'


def _faked(tmp_path, name: str, stages: str, **fakes: str) -> tuple[int, dict[str, str], str]:
    """run.sh --stages STAGES with GPU_CHECK_FAKE_* (the probe's: a GPU, at
    once): its exit status, each step's verdict and the summary."""
    env = _env(tmp_path / name, GPU_CHECK_FAKE_PROBE=FAKE_GPU, **fakes)
    run = subprocess.run(["bash", RUN_SH, "--stages", stages], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    summary = (tmp_path / name / "out" / "summary.txt").read_text()
    assert run.returncode == {"PASS": 0, "FAIL": 1}.get(summary.split()[3].rstrip(";"), 2), \
        run.stdout + run.stderr
    return run.returncode, dict(_summary_stages(summary)), summary


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_faked_failures_never_pass(tmp_path):
    """Each fault alone makes its step FAIL or INCOMPLETE; the same fakes
    without the fault make it PASS (so the fault, not the fake, decides)."""
    bench = tmp_path / "fake_bench.py"
    bench.write_text(FAKE_BENCH)

    def fake_bench(mode: str) -> str:
        return f"{sys.executable} {bench} {mode}"
    # The control: a complete, finite JSON and exit 0; a memcheck with its summary.
    rc, steps, summary = _faked(tmp_path, "control", "bench,memcheck",
                                GPU_CHECK_FAKE_BENCH=fake_bench("ok"),
                                GPU_CHECK_FAKE_MEMCHECK=MEMCHECK_OK)
    assert steps == {"bench": "PASS", "memcheck": "PASS"}, summary
    # The benchmark exits 1 after its JSON is complete; memcheck never says ERROR SUMMARY.
    rc, steps, summary = _faked(tmp_path, "exit1", "bench,memcheck",
                                GPU_CHECK_FAKE_BENCH=fake_bench("exit1"),
                                GPU_CHECK_FAKE_MEMCHECK='echo "1 passed in 0.1s"')
    assert rc == 1 and steps == {"bench": "FAIL", "memcheck": "INCOMPLETE"}, summary
    assert "no ERROR SUMMARY line" in summary and "exit 1" in summary, summary
    # A merge cell whose figure is NaN.
    rc, steps, summary = _faked(tmp_path, "nan", "bench", GPU_CHECK_FAKE_BENCH=fake_bench("nan"))
    assert rc == 1 and steps == {"bench": "FAIL"}, summary
    assert "merge 1x4x256x16: ratio not finite" in summary, summary
    # A stage out of time, its command having started a process in a session of
    # its own (out of reach of `timeout`): INCOMPLETE, and that process ended.
    pid_file = tmp_path / "escaped.pid"
    rc, steps, summary = _faked(
        tmp_path, "hang", "bench", GPU_CHECK_CAP_BENCH="3",
        GPU_CHECK_FAKE_BENCH=f"setsid sleep 300 & echo $! > {pid_file}; sleep 300")
    assert rc == 2 and steps == {"bench": "INCOMPLETE"}, summary
    assert "timed out after 3s" in summary, summary
    assert not _alive(int(pid_file.read_text())), "the escaped process outlived its stage"
    # A probe that hangs: the summary is written, the verdict INCOMPLETE, no stage ran.
    env = _env(tmp_path / "probe", GPU_CHECK_PROBE_LIMIT="2", GPU_CHECK_FAKE_PROBE="sleep 300")
    run = subprocess.run(["bash", RUN_SH], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    summary = (tmp_path / "probe" / "out" / "summary.txt").read_text()
    assert run.returncode == 2, run.stdout + run.stderr
    assert summary.startswith("=== GPU check: INCOMPLETE"), summary
    assert _summary_stages(summary) == [("probe", "INCOMPLETE")], summary
    assert "timed out after 2s" in summary and "no stage ran" in summary, summary
