"""Shared fixtures: persistent gloo rank pools (one per world size, reused by
every test of the session) and the threaded-process-group runner. The tests
live in one folder per feature (tests/<feature>/test_*.py); their shared
helpers in tests/support/, which goes on sys.path here."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))
# Inductor compiles in-process: its default pool of one compile worker per core,
# started by every test process and rank process, made the compile tests 3x
# slower here and timed them out on a 16-core GPU machine running 12 workers.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

from harness import RankPool, _restore_process_state, run_threaded  # noqa: E402

_pools: dict[int, RankPool] = {}


def _pool(world_size: int) -> RankPool:
    pool = _pools.get(world_size)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.close(force=True)
        pool = _pools[world_size] = RankPool(world_size)
    return pool


@pytest.fixture(scope="session")
def ranks():
    """``ranks(n).run(fn, *args)`` runs ``fn`` on ``n`` persistent gloo ranks."""
    yield _pool
    for pool in _pools.values():
        pool.close()
    _pools.clear()


@pytest.fixture
def threaded():
    """``threaded(n, fn, *args)`` runs ``fn`` on a threaded process group."""
    return run_threaded


@pytest.fixture(autouse=True)
def _fresh_process_state():
    """What one test switched in this process (the reference ring) is undone
    before the next: a test's result never depends on the order."""
    yield
    _restore_process_state()
