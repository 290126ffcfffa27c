"""The switch of the handshake that cplib's communicating ops begin with (see
cplib/comm/handshake.py): on by default, off with ``CPLIB_CHECK_CONSISTENCY=0``
for those who want the last fraction of a percent; a rank's invalid input
then raises on that rank only, and ranks that disagree are not told.

The native ops read the environment at each call, so the switch below is the
environment variable itself (per process)."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

__all__ = ["consistency_checks_enabled", "set_consistency_checks", "consistency_checks"]

_ENV = "CPLIB_CHECK_CONSISTENCY"


def consistency_checks_enabled() -> bool:
    """Whether cplib's ops begin with the handshake (the default)."""
    return os.environ.get(_ENV) != "0"


def set_consistency_checks(enabled: bool) -> bool:
    """Turns the handshake on or off for this process; returns the previous setting."""
    previous = consistency_checks_enabled()
    if enabled:
        os.environ.pop(_ENV, None)
    else:
        os.environ[_ENV] = "0"
    return previous


@contextlib.contextmanager
def consistency_checks(enabled: bool = True) -> Iterator[None]:
    """``with cplib.consistency_checks(False):`` turns the handshake off for
    the block and restores the previous setting on every exit path."""
    previous = set_consistency_checks(enabled)
    try:
        yield
    finally:
        set_consistency_checks(previous)
