"""The bad-input matrix: bad input to every public communicating op and to
context_parallel, in three kinds: the same bad input on every rank, bad
input on one rank, and ranks whose calls disagree. Every rank must raise the
same exception class, quickly, naming what is wrong; no rank may hang or die.
The ranks' process groups time out after 15 s, so a regression fails here
instead of hanging CI.

The cases are written per feature (bad_input_ops.py, bad_input_frontend.py)
and asserted by a test file in each feature's folder
(tests/<feature>/test_*_bad_input.py, through ``check``). All cases of a
world size run in one spawn, the first time a test asks for one of them (each
case on a fresh group, so a case that went wrong cannot misalign the next);
each test then reads its case's outcome."""

from __future__ import annotations

import time

import torch.distributed as dist

from bad_input_frontend import FRONTEND_CASES
from bad_input_ops import OPS_CASES
from harness import RankPool

TIMEOUT_S = 15.0
QUICK_S = 5.0  # a handshake answers in milliseconds; the timeout is 15 s

# (name, world size, case, exception class, text every rank's message contains)
CASES = OPS_CASES + FRONTEND_CASES
_BY_NAME = {c[0]: c for c in CASES}
# Which feature's test file asserts a case, by the first part of its name.
FEATURE_OF = {
    "ring": "ring", "ring-backward": "ring", "ops": "comm",
    "ulysses": "ulysses", "usp": "ulysses",
    "flex": "flex", "flex-style": "flex",
    "conv": "conv",
    "shard": "frontend", "unshard": "frontend", "cp-unshard": "frontend", "cp": "frontend",
    "cp-sdpa": "frontend", "cp-mha": "frontend", "style": "frontend",
}


def names(feature: str) -> list[str]:
    """The cases ``feature``'s test file asserts."""
    return [c[0] for c in CASES if FEATURE_OF.get(c[0].split("/")[0]) == feature]


def _run_cases(case_names: list[str]) -> dict[str, tuple[str | None, str, float]]:
    """Every case on a fresh group: (exception class, message, seconds)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for name in case_names:
        g = dist.new_group(list(range(n)))
        start = time.monotonic()
        try:
            _BY_NAME[name][2](rank, g)
            out[name] = (None, "", time.monotonic() - start)
        except Exception as exc:  # the outcome is what the test checks
            out[name] = (type(exc).__name__, str(exc), time.monotonic() - start)
    return out


_outcomes: dict[int, list[dict]] = {}


def _outcome(world_size: int, name: str) -> list[tuple[str | None, str, float]]:
    if world_size not in _outcomes:
        pool = RankPool(world_size, timeout_s=TIMEOUT_S)
        try:
            _outcomes[world_size] = pool.run(
                _run_cases, [c[0] for c in CASES if c[1] == world_size])
        finally:
            pool.close()
    return [per_rank[name] for per_rank in _outcomes[world_size]]


def check(name: str) -> None:
    """Every rank raised the case's class, quickly, with its text, and (but
    for USP, whose ranks see the error in different sub-groups) the same
    message."""
    _, world_size, _, exc_type, text = _BY_NAME[name]
    outcome = _outcome(world_size, name)
    for rank, (cls, msg, seconds) in enumerate(outcome):
        assert cls == exc_type.__name__, f"rank {rank}: {cls}: {msg}"
        assert text in msg, f"rank {rank}: {msg!r} lacks {text!r}"
        assert seconds < QUICK_S, f"rank {rank} took {seconds:.1f} s: {msg}"
    assert len({msg for _, msg, _ in outcome}) == 1 or name.startswith("usp/"), outcome
