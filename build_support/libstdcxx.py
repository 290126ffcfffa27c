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
