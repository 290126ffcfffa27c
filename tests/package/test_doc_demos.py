"""Every page's demo, run as a user runs it: each code block of README.md
and docs/*.md that opens with ``# name.py: torchrun --standalone
--nproc-per-node N name.py`` is saved as that file and run so, on gloo (its
N ranks started as torchrun starts them). It must exit 0, and leave no process group alive after its
``destroy_process_group()``: a group that a global still holds (a mesh, a
context's handle, a cache) can abort the interpreter at exit ("terminate
called without an active exception", seen in 2 of 10 runs of the README's
quickstart when it kept its mesh; docs/comm.md says why), so the demos a
user copies let go of theirs. The groups are counted by weak references,
taken as ``init_process_group`` and ``new_group`` make them."""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import subprocess
import sys

import pytest

from exit_scenario import free_port
from harness import cplib_import_root

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_DEMO = re.compile(r"```python\n(# (\w+\.py): torchrun --standalone --nproc-per-node (\d+) \2\n"
                   r".*?)```", re.S)
_IMPORTS = re.compile(r"^(?:from|import) (\w+)", re.M)

# Runs before the demo: weak references to every group it makes.
_TRACK = """\
import weakref as _weakref
import torch.distributed as _dist

_made = []


def _tracking(make):
    def tracked(*args, **kwargs):
        made = make(*args, **kwargs)
        group = _dist.group.WORLD if made is None else made
        if isinstance(group, _dist.ProcessGroup):  # not new_group's mark for a non-member
            _made.append(_weakref.ref(group))
        return made
    return tracked


_dist.init_process_group = _tracking(_dist.init_process_group)
_dist.new_group = _tracking(_dist.new_group)
"""
# Runs after it, where the interpreter would begin to exit.
_CHECK = """
print(f"demo check: {sum(ref() is not None for ref in _made)} of {len(_made)} groups alive",
      flush=True)
"""


def _launch(script, ranks: int) -> tuple[str, str]:
    """Runs ``script`` on ``ranks`` local processes as torchrun's workers run
    (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set; without
    its agent process, which would add a start-up per demo); asserts that
    each exits 0. Returns their stdout, and everything for a message."""
    base = dict(os.environ, PYTHONPATH=cplib_import_root() + os.pathsep
                + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks))
    # Files, not pipes: a rank blocked on a full pipe would stall the others.
    logs = [(script.parent / f"rank{r}.out", script.parent / f"rank{r}.err")
            for r in range(ranks)]
    procs = []
    try:
        for r, (out, err) in enumerate(logs):
            with open(out, "w") as o, open(err, "w") as e:
                procs.append(subprocess.Popen([sys.executable, str(script)], cwd=script.parent,
                                              stdout=o, stderr=e,
                                              env=dict(base, RANK=str(r), LOCAL_RANK=str(r))))
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = [(code, out.read_text(), err.read_text()) for code, (out, err) in zip(codes, logs)]
    stdout = "".join(out for _, out, _ in results)
    output = "".join(f"--- rank {r} (exit {code}):\n{out}{err[-3000:]}"
                     for r, (code, out, err) in enumerate(results))
    assert all(code == 0 for code, _, _ in results), f"{script.name} failed:\n{output}"
    return stdout, output


def _demos() -> list[tuple[str, str, int, str]]:
    pages = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs",
                                                                              "*.md")))
    return [(os.path.relpath(page, ROOT), name, int(ranks), body)
            for page in pages for body, name, ranks in _DEMO.findall(open(page).read())]


DEMOS = _demos()


def test_every_page_with_a_demo_is_found():
    assert len(DEMOS) >= 12, [d[:2] for d in DEMOS]


@pytest.mark.parametrize("page,name,ranks,body", DEMOS, ids=[f"{p}:{n}" for p, n, _, _ in DEMOS])
def test_demo_runs_and_lets_go_of_its_groups(tmp_path, page, name, ranks, body):
    for module in sorted(set(_IMPORTS.findall(body))):
        if importlib.util.find_spec(module) is None:
            # make build installs every demo's imports (requirements-dev.txt,
            # requirements/clients.txt); a bare environment may lack one.
            pytest.skip(f"{page}'s {name} imports {module}, which is not installed here "
                        "(requirements-dev.txt pins it: make build installs it)")
    script = tmp_path / name
    script.write_text(_TRACK + body + _CHECK)
    stdout, output = _launch(script, ranks)
    checks = re.findall(r"demo check: (\d+) of (\d+) groups alive", stdout)
    assert len(checks) == ranks, output
    assert all(alive == "0" and made != "0" for alive, made in checks), \
        f"{page}'s {name} keeps a process group alive past destroy_process_group() " \
        f"(alive of made, per rank: {checks}): let go of what holds it first\n{output}"
