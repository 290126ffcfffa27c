"""The handshake (on by default; CPLIB_CHECK_CONSISTENCY=0 turns it off):
when ranks make different calls, or one rank's input is invalid, every rank
raises the same ValueError before the first collective, so nothing hangs.
tests/support/bad_input.py has the full matrix of bad inputs."""

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
    """_error_of with the handshake on (the default, switched explicitly in
    this rank's own process)."""
    with cplib.consistency_checks():
        return _error_of(fn)


def _ring_call(length: int, is_causal: bool = True):
    q = torch.randn(1, 2, length, 8)
    return lambda: cplib.ring_sdpa(q, q, q, dist.group.WORLD, is_causal=is_causal,
                                   load_balanced=True)


def _check_mismatches() -> list[str]:
    rank = dist.get_rank()
    messages = [
        # A different local length.
        _expect_same_error(_ring_call(8 if rank == 0 else 6)),
        # A bad scale fails rank 1's own check, and every rank says so.
        _expect_same_error(lambda: cplib.ring_sdpa(
            *[torch.randn(1, 2, 8, 8)] * 3, dist.group.WORLD, scale=-1.0 if rank == 1 else None)),
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
    ring_len, ring_scale, ring_causal, flex, conv = results[0]
    # Causal, load-balanced shards of lengths no one sequence's layout gives.
    assert re.search(r"local lengths differ \(q \[8, 6[],]", ring_len), ring_len
    assert re.search(r"ring_sdpa: invalid input on rank 1[: ].*scale=-1\.0 must be a finite "
                     r"positive number", ring_scale), ring_scale
    assert "ranks disagree on is_causal (rank 0: True, rank 1: False" in ring_causal, ring_causal
    assert "flex_cp_allgather: ranks disagree on k.size(2)" in flex, flex
    assert "tp_convolution: ranks disagree on padding[0]" in conv, conv


def _off_then_on() -> tuple[str, str]:
    """A valid call computes with the handshake off; a rank's bad scale then
    raises on that rank only (checked here on one rank, without any
    collective), and with the handshake on on every rank."""
    rank = dist.get_rank()
    q = torch.randn(1, 2, 8, 8)
    with cplib.consistency_checks(False):
        out, _ = cplib.ring_sdpa(q, q, q, dist.group.WORLD, is_causal=True)
        assert out.shape == q.shape
        local = _error_of(lambda: cplib.ring_sdpa(q, q, q, dist.group.WORLD, scale=-1.0)) \
            if rank == 1 else ""
    everywhere = _error_of(lambda: cplib.ring_sdpa(q, q, q, dist.group.WORLD,
                                                   scale=-1.0 if rank == 1 else None))
    return local, everywhere


def test_switch_off_behaves_as_before(ranks):
    (local0, every0), (local1, every1) = ranks(2).run(_off_then_on)
    assert local0 == "" and "scale=-1.0 must be a finite positive number" in local1
    assert "invalid input on rank 1" not in local1
    assert every0 == every1 and "ring_sdpa: invalid input on rank 1: " in every0, every0


def test_threaded_group(threaded):
    results = threaded(2, lambda: _error_of(_ring_call(8 + 2 * dist.get_rank())))
    assert results[0] == results[1] and "local lengths differ (q [8, 10]" in results[0]


def test_switch_restores_previous_setting(monkeypatch):
    monkeypatch.delenv("CPLIB_CHECK_CONSISTENCY", raising=False)
    assert cplib.consistency_checks_enabled()
    with cplib.consistency_checks(False):
        assert not cplib.consistency_checks_enabled()
        with cplib.consistency_checks():
            assert cplib.consistency_checks_enabled()
        assert not cplib.consistency_checks_enabled()
    assert cplib.consistency_checks_enabled()
    monkeypatch.setenv("CPLIB_CHECK_CONSISTENCY", "0")
    assert not cplib.consistency_checks_enabled()
