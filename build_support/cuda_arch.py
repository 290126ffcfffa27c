"""The GPU architectures a CUDA shared object carries: the SASS (cubin) and
PTX entries of its fat binaries, read from the ELF's ``.nv_fatbin`` section
(no cuobjdump needed, which CI machines lack).

    python build_support/cuda_arch.py cplib/_C.abi3.so      # prints sm_80 sm_90 sm_100 ptx_100
    python build_support/cuda_arch.py WHEEL.whl --require 80,90,100 --ptx 100

A fat binary is a 16-byte header (magic 0xBA55ED50, version, header size,
size of what follows) and entries back to back, each with its own header:
kind (1 PTX, 2 ELF), header size, payload size, and the SM number at byte 28.
"""

from __future__ import annotations

import argparse
import struct
import sys
import zipfile

FATBIN_MAGIC = 0xBA55ED50
KIND = {1: "ptx", 2: "sm"}


def _section(elf: bytes, name: bytes) -> bytes | None:
    """The bytes of the ELF64 little-endian section ``name``, or None."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    def header(i):
        return struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize)
    _, _, _, _, str_off, str_size = header(shstrndx)
    names = elf[str_off:str_off + str_size]
    for i in range(shnum):
        name_at, _, _, _, off, size = header(i)
        if names[name_at:names.index(b"\0", name_at)] == name:
            return elf[off:off + size]
    return None


def fatbin_entries(data: bytes) -> list[tuple[str, int]]:
    """(kind, sm) of every entry of every fat binary in ``data``."""
    entries, pos = [], 0
    while pos + 16 <= len(data):
        magic, _, hsize, size = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:
            pos += 8  # containers are 8-byte aligned
            continue
        at, end = pos + hsize, pos + hsize + size
        while at + 32 <= end:
            kind, _, ehsize, esize = struct.unpack_from("<HHIQ", data, at)
            arch, = struct.unpack_from("<I", data, at + 28)
            if ehsize == 0:
                break
            entries.append((KIND.get(kind, f"kind{kind}"), arch))
            at += ehsize + esize
        pos = end
    return entries


def architectures(path: str) -> dict[str, list[int]]:
    """{"sm": [...], "ptx": [...]}: the SM numbers of the SASS and PTX entries
    of ``path`` (a shared object, or a wheel: its cplib/_C*.so)."""
    if path.endswith(".whl"):
        with zipfile.ZipFile(path) as z:
            names = [n for n in z.namelist() if n.startswith("cplib/_C") and n.endswith(".so")]
            if len(names) != 1:
                raise ValueError(f"{path}: expected one cplib/_C*.so, found {names}")
            elf = z.read(names[0])
    else:
        with open(path, "rb") as f:
            elf = f.read()
    section = _section(elf, b".nv_fatbin")
    found: dict[str, set[int]] = {"sm": set(), "ptx": set()}
    for kind, sm in fatbin_entries(section or b""):
        found.setdefault(kind, set()).add(sm)
    return {k: sorted(v) for k, v in found.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("path", help="a shared object or a cplib wheel")
    p.add_argument("--require", default="", help="SM numbers that must have SASS, e.g. 80,90,100")
    p.add_argument("--ptx", default="", help="SM numbers that must have PTX, e.g. 100")
    args = p.parse_args(argv)
    found = architectures(args.path)
    print(" ".join([f"sm_{s}" for s in found["sm"]] + [f"ptx_{s}" for s in found["ptx"]])
          or "no CUDA code")
    missing = [f"sm_{s}" for s in args.require.split(",") if s and int(s) not in found["sm"]]
    missing += [f"ptx_{s}" for s in args.ptx.split(",") if s and int(s) not in found["ptx"]]
    if missing:
        print(f"cuda_arch: {args.path} lacks {' '.join(missing)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
