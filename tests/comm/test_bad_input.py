"""The bad-input matrix (tests/support/bad_input.py) as a whole: every case
is asserted by its feature's test file (tests/<feature>/test_*_bad_input.py),
and the cases of no one feature (ranks in different ops) are asserted here."""

from __future__ import annotations

import os

import pytest

from bad_input import CASES, FEATURE_OF, check, names

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name", names("comm"))
def test_every_rank_raises_alike(name):
    check(name)


def test_every_case_has_its_feature_file():
    prefixes = {c[0].split("/")[0] for c in CASES}
    assert prefixes <= set(FEATURE_OF), sorted(prefixes - set(FEATURE_OF))
    for feature in set(FEATURE_OF.values()):
        assert names(feature), f"no case for {feature}"
        files = [f for f in os.listdir(os.path.join(TESTS, feature)) if f.endswith("bad_input.py")]
        texts = [open(os.path.join(TESTS, feature, f)).read() for f in files]
        assert any(f'names("{feature}")' in t for t in texts), \
            f"no tests/{feature}/test_*bad_input.py asserts names({feature!r})"
