"""The GPU check's install stage (benchmarks/gpu/run.sh), in Python:

    python install_check.py wheel WHEEL SITE PREP [--cuda]
        installs WHEEL into the folder SITE beside the running torch (pip
        --no-deps --no-index --target; a plain unzip where pip is missing),
        then checks, with SITE first on the path and from outside the tree:
        the extension imported is the wheel's byte for byte
        (build_support/check_wheel.py), the tree's sources are the ones the
        wheel was built from (build_support/gpu_prep.py check PREP), and the
        common checks below;
    python install_check.py built [--cuda]
        the common checks of the extension built in place (PYTHONPATH = the tree).

Common checks: _C does not carry its own libstdc++ (every error message would
crash the process), has its CUDA kernels (--cuda), and bad input raises
ValueError. Prints one line per check; exit status 0 when all pass.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_COMMON = r"""
import sys, torch
sys.path.insert(0, sys.argv[2])  # build_support, not the package
from libstdcxx import carries_private_libstdcxx
import cplib
so = cplib._C.__file__
print("cplib from", so)
if sys.argv[3]:  # the wheel's extension, byte for byte
    import check_wheel
    if check_wheel.main(sys.argv[3]):
        raise SystemExit("the extension imported is not the wheel's")
if carries_private_libstdcxx(so):
    raise SystemExit(f"{so} carries its own libstdc++: rebuild with CXX=/usr/bin/g++")
if sys.argv[1] == "1":
    assert torch._C._dispatch_has_kernel_for_dispatch_key("cplib_c::ring_sdpa", "CUDA"), \
        "cplib was built without its CUDA kernels"
    print("CUDA kernels: registered")
try:
    cplib.merge_partial_(torch.zeros(1, 1, 2, 3), torch.zeros(1, 1, 2), torch.zeros(1, 1, 5, 3),
                         torch.zeros(1, 1, 5), 0)
except ValueError as exc:
    print("bad input raised ValueError:", str(exc).splitlines()[0][:100])
else:
    raise SystemExit("bad input did not raise ValueError")
"""


def _run(argv: list[str], env: dict | None = None) -> bool:
    """Runs argv from / (the tree's cplib must not shadow the installed one)."""
    done = subprocess.run(argv, cwd="/", env=env, capture_output=True, text=True)
    print((done.stdout + done.stderr).strip())
    return done.returncode == 0


def common_checks(cuda: bool, env: dict, wheel: str = "") -> bool:
    """One process (torch imports in seconds): the checks above, and with
    ``wheel`` first build_support/check_wheel.py's."""
    return _run([sys.executable, "-c", _COMMON, "1" if cuda else "0",
                 os.path.join(ROOT, "build_support"), wheel], env)


def install(wheel: str, site: str) -> bool:
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index",
                          "--force-reinstall", "--target", site, wheel],
                         capture_output=True, text=True)
    if pip.returncode == 0:
        print(f"pip installed {os.path.basename(wheel)} into {site}")
        return True
    print(f"pip failed ({pip.stderr.strip().splitlines()[-1:] or pip.returncode}); unzipping")
    with zipfile.ZipFile(wheel) as z:  # a wheel is a zip of the install tree
        z.extractall(site)
    return True


def main(argv: list[str]) -> int:
    cuda = "--cuda" in argv
    argv = [a for a in argv if a != "--cuda"]
    env = dict(os.environ)
    if argv[:1] == ["wheel"] and len(argv) == 4:
        wheel, site, prep = argv[1:]
        ok = install(wheel, site)
        env["PYTHONPATH"] = site
        ok = _run([sys.executable, os.path.join(ROOT, "build_support", "gpu_prep.py"), "check",
                   prep], env) and ok
        return 0 if common_checks(cuda, env, os.path.abspath(wheel)) and ok else 1
    if argv == ["built"]:
        env["PYTHONPATH"] = ROOT
        return 0 if common_checks(cuda, env) else 1
    print(__doc__)
    return 64


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
