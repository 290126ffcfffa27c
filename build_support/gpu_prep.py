"""The prepared folder the GPU check takes to the GPU machine (``make
gpu-prep``): the CUDA wheel and ``prep.json`` (the commit it was built from,
whether the tree had uncommitted changes, a hash of the sources that go into
the wheel, the wheel's sha256 and CUDA architectures).

    python build_support/gpu_prep.py write WHEEL FOLDER    # here, where .git is
    python build_support/gpu_prep.py check FOLDER          # there: sources unchanged?
    python build_support/gpu_prep.py commit [FOLDER]       # the commit line for the outputs

The GPU machine gets the tree without .git, so the commit can only come from
this folder; ``check`` recomputes the source hash there and fails when the
tree's sources are not the ones the wheel was built from (a stale wheel).
``commit`` without a folder (or with an empty one) gives git's HEAD where
the tree has its history, else says the commit is unknown, and why.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ("csrc", "cplib", "setup.py", "pyproject.toml")
SKIP_DIRS = {"__pycache__", ".pytest_cache"}
SKIP_SUFFIXES = (".so", ".pyc", ".pyo", ".o", ".tmp")


def source_files(root: str = ROOT) -> list[str]:
    """The files the wheel is built from, relative to ``root``, sorted."""
    files = []
    for top in SOURCES:
        path = os.path.join(root, top)
        if os.path.isfile(path):
            files.append(top)
            continue
        for folder, dirs, names in os.walk(path):
            dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info"))
            files += [os.path.relpath(os.path.join(folder, n), root) for n in names
                      if not n.endswith(SKIP_SUFFIXES)]
    return sorted(files)


def source_hash(root: str = ROOT) -> str:
    h = hashlib.sha256()
    for rel in source_files(root):
        with open(os.path.join(root, rel), "rb") as f:
            data = f.read()
        h.update(rel.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
    return h.hexdigest()


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True,
                          timeout=60).stdout


def write(wheel: str, folder: str) -> dict:
    """Copies ``wheel`` into ``folder`` (emptied first) with prep.json."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from cuda_arch import architectures

    commit = _git("rev-parse", "HEAD").strip()
    changed = [line[3:] for line in _git("status", "--porcelain").splitlines() if line.strip()]
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    dest = os.path.join(folder, os.path.basename(wheel))
    shutil.copyfile(wheel, dest)
    with open(dest, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    info = dict(commit=commit, dirty=bool(changed), changed=changed[:50],
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                wheel=os.path.basename(wheel), wheel_sha256=sha, sources_sha256=source_hash(),
                cuda_architectures=architectures(dest))
    with open(os.path.join(folder, "prep.json"), "w") as f:
        json.dump(info, f, indent=2)
    return info


def read(folder: str) -> dict | None:
    try:
        with open(os.path.join(folder, "prep.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def commit_line(folder: str | None) -> str:
    """The commit as every output of the GPU check records it."""
    info = read(folder) if folder else None
    if info is None:
        try:  # a checkout with its history (a GPU machine of one's own)
            head = _git("rev-parse", "HEAD").strip()
            dirty = _git("status", "--porcelain", "--untracked-files=no").strip()
            return (f"{head}{'-dirty' if dirty else ''} "
                    "(no prepared wheel: built from this checkout)")
        except (OSError, subprocess.SubprocessError):
            return ("unknown (no prepared wheel carried: the extension was built from the tree "
                    "as it is, which travels without .git; `make gpu-prep` where .git is "
                    "records it)")
    dirty = f", plus uncommitted changes to {len(info['changed'])} files" if info["dirty"] else ""
    return f"{info['commit']}{dirty} (the wheel's, prepared {info['date']})"


def check(folder: str) -> int:
    """0 when the tree's sources are the wheel's, else 1 (printed)."""
    info = read(folder)
    if info is None:
        print(f"gpu_prep: no prep.json in {folder}")
        return 1
    now = source_hash()
    if now != info["sources_sha256"]:
        print(f"gpu_prep: the sources here (sha256 {now[:12]}) are not those the wheel was "
              f"built from ({info['sources_sha256'][:12]}): run `make gpu-prep` again")
        return 1
    print(f"gpu_prep: the sources here are the wheel's (sha256 {now[:12]})")
    return 0


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "write":
        info = write(argv[1], argv[2])
        arch = info["cuda_architectures"]
        print(f"gpu_prep: {argv[2]}/{info['wheel']} from {commit_line(argv[2])}; CUDA "
              + (" ".join([f"sm_{s}" for s in arch["sm"]] + [f"ptx_{s}" for s in arch["ptx"]])
                 or "none"))
        return 0
    if len(argv) == 2 and argv[0] == "check":
        return check(argv[1])
    if argv[:1] == ["commit"] and len(argv) <= 2:
        print(commit_line(argv[1] if len(argv) == 2 else None))
        return 0
    print(__doc__)
    return 64


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
