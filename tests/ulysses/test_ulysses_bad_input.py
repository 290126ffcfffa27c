"""Bad input to ulysses_sdpa and usp_sdpa (also through context_parallel):
their cases of the bad-input matrix (tests/support/bad_input.py: every rank
raises alike, quickly, naming what is wrong)."""

from __future__ import annotations

import pytest

from bad_input import check, names


@pytest.mark.parametrize("name", names("ulysses"))
def test_every_rank_raises_alike(name):
    check(name)
