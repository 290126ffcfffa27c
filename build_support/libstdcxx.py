"""Build-time guard against an extension that carries its own libstdc++.

Some toolchains (a GCC wrapper outside /usr/bin, seen on a GPU image) link
libstdc++ statically into the extension. torch's own libstdc++ is loaded too,
and formatting any TORCH_CHECK message then crashes inside std::ostream, so
every ValueError becomes a segfault."""

from __future__ import annotations

import os
import subprocess


def carries_private_libstdcxx(path: str) -> bool | None:
    """True when the shared object defines std::ostream's symbols itself
    without depending on libstdc++.so; None when binutils cannot tell."""
    try:
        needed = subprocess.run(["readelf", "-d", path], capture_output=True, text=True,
                                check=True).stdout
        defined = subprocess.run(["nm", "-D", "--defined-only", path], capture_output=True,
                                 text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    ostream = any(line.split()[-1].startswith("_ZNSo") for line in defined.splitlines()
                  if line.strip())
    return ostream and "libstdc++" not in needed


def refuse_private_libstdcxx(path: str) -> None:
    """Removes ``path`` and raises RuntimeError if it carries its own libstdc++
    (unless CPLIB_ALLOW_STATIC_LIBSTDCXX=1)."""
    if os.environ.get("CPLIB_ALLOW_STATIC_LIBSTDCXX") == "1":
        return
    verdict = carries_private_libstdcxx(path)
    if verdict is None:
        print(f"cplib: readelf/nm could not inspect {path} for a private libstdc++; not checked")
    elif verdict:
        os.remove(path)
        raise RuntimeError(
            f"cplib: {os.path.basename(path)} was linked with its own copy of libstdc++ "
            f"(CXX={os.environ.get('CXX', 'c++')} links it statically). Every error message "
            "would then crash the process. Build with the system compiler: "
            "CC=/usr/bin/gcc CXX=/usr/bin/g++ (set CPLIB_ALLOW_STATIC_LIBSTDCXX=1 to keep it)."
        )


# A probe that pulls std::ostream in, as every TORCH_CHECK message does.
_PROBE_SOURCE = ('#include <sstream>\n'
                 'extern "C" int cplib_probe(long x) { std::ostringstream s; s << x; '
                 'return (int)s.str().size(); }\n')


def links_libstdcxx_dynamically(cxx: str) -> bool:
    """True when the C++ compiler ``cxx`` (a path or a name on PATH, possibly
    with a launcher: "ccache g++") links a shared object against the shared
    libstdc++.so: it must find libstdc++.so (``-print-file-name``), and a
    probe object it links must depend on libstdc++ without defining
    std::ostream itself."""
    import shutil
    import tempfile

    argv = cxx.split()
    if not argv or shutil.which(argv[0]) is None:
        return False
    try:
        found = subprocess.run([*argv, "-print-file-name=libstdc++.so"], capture_output=True,
                               text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return False
    if not os.path.isabs(found) or not os.path.exists(found):
        return False  # only a static libstdc++.a (or none) to link with
    with tempfile.TemporaryDirectory() as tmp:
        src, out = os.path.join(tmp, "probe.cpp"), os.path.join(tmp, "probe.so")
        with open(src, "w") as f:
            f.write(_PROBE_SOURCE)
        try:
            subprocess.run([*argv, "-shared", "-fPIC", src, "-o", out], capture_output=True,
                           timeout=120, check=True)
        except (OSError, subprocess.TimeoutExpired, subprocess.CalledProcessError):
            return False
        return carries_private_libstdcxx(out) is False


# Compilers tried after the environment's CXX, in order, with their C twin.
SYSTEM_COMPILERS = (("/usr/bin/gcc", "/usr/bin/g++"), ("gcc", "g++"), ("cc", "c++"))


def choose_compilers(env: dict[str, str] | None = None) -> tuple[str, str, str]:
    """(CC, CXX, why) for building the extension: the environment's CXX (with
    its CC) when it links libstdc++ dynamically, else the first system
    compiler that does. A GPU image exporting CXX=/opt/gcc/bin/g++ (a GCC that
    links libstdc++ statically) thus gets /usr/bin/g++. Raises RuntimeError
    when no compiler qualifies."""
    env = os.environ if env is None else env
    given_cxx, given_cc = env.get("CXX", ""), env.get("CC", "")
    if given_cxx and links_libstdcxx_dynamically(given_cxx):
        return given_cc or "cc", given_cxx, f"CXX={given_cxx} from the environment"
    for cc, cxx in SYSTEM_COMPILERS:
        if links_libstdcxx_dynamically(cxx):
            why = (f"CXX={given_cxx} links libstdc++ statically (or cannot link); using {cxx}"
                   if given_cxx else f"CXX unset; using {cxx}")
            return cc, cxx, why
    raise RuntimeError(f"cplib: no C++ compiler links libstdc++ dynamically (tried CXX="
                       f"{given_cxx or '(unset)'} and {', '.join(c for _, c in SYSTEM_COMPILERS)})")


if __name__ == "__main__":
    # `python build_support/libstdcxx.py`: prints "CC CXX" on line 1 and why on line 2.
    import sys
    try:
        chosen_cc, chosen_cxx, reason = choose_compilers()
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        sys.exit(1)
    print(chosen_cc, chosen_cxx)
    print(reason)
