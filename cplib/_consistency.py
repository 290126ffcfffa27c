"""Check mode: before their first collective, cplib's communicating ops
compare a description of the call (shapes, dtypes, flags) across the ranks of
the group, and every rank raises the same ValueError when they disagree,
instead of one rank raising and the others waiting for the process-group
timeout. On with ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (torch's convention) or
``CPLIB_CHECK_CONSISTENCY=1``; it costs one small all-gather per op call.

The native ops read the environment at each call, so the switch below is the
environment variable itself (per process, like torch's own debug level)."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

__all__ = ["consistency_checks_enabled", "set_consistency_checks", "consistency_checks"]

_ENV = "CPLIB_CHECK_CONSISTENCY"


def consistency_checks_enabled() -> bool:
    """Whether cplib's ops compare their calls across ranks first."""
    return (os.environ.get("TORCH_DISTRIBUTED_DEBUG") == "DETAIL"
            or os.environ.get(_ENV) == "1")


def set_consistency_checks(enabled: bool) -> bool:
    """Turns cplib's check mode on or off for this process (it stays on while
    ``TORCH_DISTRIBUTED_DEBUG=DETAIL``); returns the previous setting of the
    cplib switch."""
    previous = os.environ.get(_ENV) == "1"
    if enabled:
        os.environ[_ENV] = "1"
    else:
        os.environ.pop(_ENV, None)
    return previous


@contextlib.contextmanager
def consistency_checks(enabled: bool = True) -> Iterator[None]:
    """``with cplib.consistency_checks():`` turns check mode on for the block
    and restores the previous setting on every exit path."""
    previous = set_consistency_checks(enabled)
    try:
        yield
    finally:
        set_consistency_checks(previous)
