"""Bad input to tp_conv: its cases of the bad-input matrix
(tests/support/bad_input.py: every rank raises alike, quickly, naming what
is wrong)."""

from __future__ import annotations

import pytest

from bad_input import check, names


@pytest.mark.parametrize("name", names("conv"))
def test_every_rank_raises_alike(name):
    check(name)
