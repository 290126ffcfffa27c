"""String arguments of the native ops are freed (csrc/torch/common/box.h).

torch's stable conversion of a ``str`` argument (the headers cplib is built
against) copies it into a string it never frees; every op taking a group
name through TORCH_BOX leaked that copy on every call. The ops read their
strings with cplib's own reader instead: calling the handshake op (a
``str``, two ``str[]``) 60 times with 100 KB strings must not grow the
process by the 18 MB those copies would take.
"""

from __future__ import annotations

import os
import re

import torch
import torch.distributed as dist

import cplib  # noqa: F401  (registers cplib_c's ops)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LONG = "x" * 100_000
CALLS = 60
# What the leak would add (3 strings of 100 KB per call), and the bound: a
# tenth of it, far above what the calls themselves leave behind.
LEAK_BYTES = CALLS * 3 * len(LONG)


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _handshake_growth() -> int:
    group = dist.group.WORLD.group_name

    def call():
        # A long op name and long value names; the group's own name stays
        # short (it goes on into torch, whose conversion of strings passed
        # into the dispatcher leaks on torch 2.11-2.14: box.h).
        torch.ops.cplib_c.handshake(group, LONG, [], [], [LONG, LONG + "y"], [1, 2], [3])

    for _ in range(5):
        call()
    before = _rss()
    for _ in range(CALLS):
        call()
    return _rss() - before


def test_string_arguments_are_freed(ranks):
    (growth,) = ranks(1).run(_handshake_growth)
    assert growth < LEAK_BYTES / 10, (
        f"{CALLS} handshake calls with three 100 KB strings each grew the process by "
        f"{growth / 2**20:.1f} MiB (a leaked copy per string: {LEAK_BYTES / 2**20:.1f} MiB)")


def _code(path: str) -> str:
    """The file without its // comments."""
    with open(path, encoding="utf-8") as fh:
        return re.sub(r"//[^\n]*", "", fh.read())


def _native_files(*parts: str) -> list[str]:
    return [os.path.join(root, name) for root, _dirs, files in os.walk(os.path.join(ROOT, *parts))
            for name in files]


def test_no_kernel_reads_strings_through_torch():
    """Every op registers through CPLIB_BOX (or reads its stack with
    StackReader), and nothing converts a stack slot to a string with torch's
    conversion: box.h's reader is the only one."""
    torch_reads = re.compile(r"TORCH_BOX\s*\(|detail::to<\s*std::(string|vector<\s*std::string)")
    found = [os.path.relpath(p, ROOT) for p in _native_files("csrc")
             if torch_reads.search(_code(p))]
    assert found == []
    impls = [" ".join(m.split()) for p in _native_files("csrc", "torch")
             for m in re.findall(r"m\.impl\(\s*\"\w+\"\s*,\s*(.*?)\);", _code(p), re.S)]
    assert len(impls) > 40, "the registrations were not found"
    # The others: kernels that read their stack with StackReader (ring_call.h), by name.
    others = [i for i in impls if not i.startswith("CPLIB_BOX(")]
    assert all(re.fullmatch(r"&\w+", i) for i in others), others
