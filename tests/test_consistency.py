"""Check mode (TORCH_DISTRIBUTED_DEBUG=DETAIL or CPLIB_CHECK_CONSISTENCY=1):
when ranks make different calls, every rank raises the same ValueError
before the first collective, so nothing hangs."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

import cplib


def _error_of(fn) -> str:
    """fn's ValueError message, or '' if it raised none."""
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return ""


def _expect_same_error(fn) -> str:
    """_error_of under check mode (switched in this rank's own process)."""
    with cplib.consistency_checks():
        return _error_of(fn)


def _ring_call(length: int, is_causal: bool = True):
    q = torch.randn(1, 2, length, 8)
    return lambda: cplib.ring_sdpa(q, q, q, dist.group.WORLD, is_causal=is_causal,
                                   load_balanced=True)


def _check_mismatches() -> list[str]:
    rank = dist.get_rank()
    messages = [
        # A different local length: an odd one would also fail load_balanced's
        # own check, on that rank only, without check mode.
        _expect_same_error(_ring_call(8 if rank == 0 else 7)),
        _expect_same_error(_ring_call(8, is_causal=rank != 1)),
        _expect_same_error(lambda: cplib.flex_cp_allgather(
            torch.randn(1, 2, 4 + rank, 8), torch.randn(1, 2, 4 + rank, 8), 2, dist.group.WORLD)),
        _expect_same_error(lambda: cplib.tp_conv(
            torch.randn(1, 3, 8, 8), torch.randn(4, 3, 3, 3), padding=1 + (rank == 1))),
    ]
    # Equal calls pass the check and compute as usual.
    with cplib.consistency_checks():
        out, _ = _ring_call(8)()
    assert out.shape == (1, 2, 8, 8)
    return messages


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_rank_raises_the_same_error(ranks, world_size):
    results = ranks(world_size).run(_check_mismatches)
    assert all(r == results[0] for r in results), "ranks raised different errors"
    ring_len, ring_causal, flex, conv = results[0]
    assert re.search(r"ranks disagree on q\.size\(2\) \(rank 0: 8, rank 1: 7", ring_len), ring_len
    assert "ranks disagree on is_causal" in ring_causal, ring_causal
    assert "flex_cp_allgather: ranks disagree on k.size(2)" in flex, flex
    assert "tp_convolution: ranks disagree on padding[0]" in conv, conv


def test_threaded_group_check_mode(threaded):
    # The switch is process-wide: set here, outside the rank threads.
    with cplib.consistency_checks():
        results = threaded(2, lambda: _error_of(_ring_call(8 + 2 * dist.get_rank())))
    assert results[0] == results[1] and "q.size(2) (rank 0: 8, rank 1: 10" in results[0]


def test_switch_restores_previous_setting(monkeypatch):
    monkeypatch.delenv("CPLIB_CHECK_CONSISTENCY", raising=False)
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG", raising=False)
    with cplib.consistency_checks():
        assert cplib.consistency_checks_enabled()
    assert not cplib.consistency_checks_enabled()
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    assert cplib.consistency_checks_enabled()
