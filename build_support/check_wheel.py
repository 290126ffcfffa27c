"""Checks that the cplib imported here runs the extension of WHEEL, byte for
byte: the one wheel was installed, not rebuilt against this torch.

    python build_support/check_wheel.py dist/cplib-<version>-cp311-abi3-<platform>.whl
"""

from __future__ import annotations

import hashlib
import sys
import zipfile


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def main(wheel: str) -> int:
    with zipfile.ZipFile(wheel) as z:
        members = [n for n in z.namelist() if n.startswith("cplib/_C") and n.endswith(".so")]
        if len(members) != 1:
            print(f"check_wheel: expected one cplib/_C*.so in {wheel}, found {members}")
            return 1
        want = _sha256(z.read(members[0]))

    import torch
    import cplib
    with open(cplib._C.__file__, "rb") as f:
        got = _sha256(f.read())
    where = f"cplib {cplib.__version__} ({cplib._C.__file__}) on torch {torch.__version__}"
    if got != want:
        print(f"check_wheel: {where} is not the wheel's extension (sha256 {got[:16]} != "
              f"{want[:16]}): it was rebuilt or installed from elsewhere")
        return 1
    print(f"check_wheel: {where}: the wheel's extension, sha256 {want[:16]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
