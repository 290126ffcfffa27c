"""strategy="auto"'s measured calibration on gloo ranks (issue 40): the first
CP call of a process calibrates under no_grad, inference_mode and autograd
alike (exact against one process, the caller's grad mode kept, nothing of
inference mode left for a later autograd call); a failure on one rank
(an exception, an out-of-memory error), in the measurement's local part or
in its exchanges, gives every rank the built-in calibration and the same
warning, never a hang; and bad input to auto (a memory limit nothing fits,
a strategy value it does not know) raises the same ValueError on every
rank before any collective of the calibration."""

from __future__ import annotations

import contextlib
import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

import cplib
from cplib.strategy import choice as choice_mod
from cplib.strategy import microbench
from harness import assert_close
from ring_cases import global_tensor, reference

TOL = dict(atol=1e-10, rtol=1e-10)
_MODES = {"autograd": contextlib.nullcontext, "no_grad": torch.no_grad,
          "inference_mode": torch.inference_mode}
_QUICK_S = 10.0  # an error agreed in a handshake: well under the 90 s rank timeout


def _mesh() -> DeviceMesh:
    return DeviceMesh("cpu", list(range(dist.get_world_size())))


def _ring_auto(mesh, q, k, v, cot, ref, grad: bool, what: str) -> None:
    """ring_sdpa(rotate="auto") on the head-tail shards of fp64 (q, k, v),
    against ``ref`` (one process): the output, and with ``grad`` the
    gradients."""
    n = mesh.size()
    lb = cplib.HeadTailLoadBalancer(q.shape[2], n, "cpu")
    ql, kl, vl, cl = cplib.shard(mesh, [q, k, v, cot], [2] * 4, lb)
    ql, kl, vl = (t.clone().requires_grad_(grad) for t in (ql, kl, vl))
    out, _ = cplib.ring_sdpa(ql, kl, vl, mesh.get_group(), is_causal=True, load_balanced=True,
                             rotate="auto")
    if grad:
        out.backward(cl)
    got = cplib.unshard(mesh, [out.detach()] + ([ql.grad, kl.grad, vl.grad] if grad else []),
                        [2] * (4 if grad else 1), lb)
    for label, g, want in zip(("out", "dq", "dk", "dv"), got, (ref[0],) + tuple(ref[2:])):
        assert_close(g, want, what=f"{label} [{what}]", **TOL)


def _inputs(n: int, seed: int) -> list:
    """q, k, v, the cotangent (fp64, full sequence) and their reference."""
    q, k, v, cot = (global_tensor((1, h, 16 * n, 8), torch.float64, seed + i)
                    for i, h in enumerate((4, 2, 2, 4)))
    return [q, k, v, cot, reference(q, k, v, cot, is_causal=True, scale=None)]


def _first_calls_in_each_mode() -> list[str]:
    """Per mode, a fresh calibration state: the first CP call made under the
    mode (it measures the calibration), then an autograd call that reuses
    the calibration measured there."""
    mesh = _mesh()
    inputs = _inputs(mesh.size(), 70)
    names = []
    try:
        for mode, context in _MODES.items():
            choice_mod.clear_caches()
            with context():
                before = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
                _ring_auto(mesh, *inputs, mode == "autograd", f"first call, {mode}")
                after = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
            assert before == after, f"{mode}: grad mode {before} became {after}"
            (cal,) = choice_mod._calibrations.values()
            assert cal.name.startswith("measured"), cal.name
            _ring_auto(mesh, *inputs, True, f"autograd after a first call in {mode}")
            names.append(cal.name)
    finally:
        choice_mod.clear_caches()
    return names


@pytest.mark.parametrize("n", [2, 4])
def test_first_call_calibrates_in_any_grad_mode(ranks, n):
    per_rank = ranks(n).run(_first_calls_in_each_mode)
    assert all(names == per_rank[0] for names in per_rank), per_rank


# ---------------------------------------------------------------- failures


class _FailingSdpa:
    """microbench's ``F`` whose SDPA raises ``error`` once armed."""

    def __init__(self, error: BaseException, armed: bool) -> None:
        self.error, self.armed = error, armed

    def scaled_dot_product_attention(self, *args, **kwargs):
        if self.armed:
            raise self.error
        return F.scaled_dot_product_attention(*args, **kwargs)


_FAILURES = {
    "exception": lambda: RuntimeError("injected calibration failure"),
    "oom": lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB "
                                          "(simulated)"),
}


def _calibrate_failing(bad_rank: int, failure: str, phase: str) -> tuple[str, list[str], float]:
    """``failure`` injected on ``bad_rank`` in the measurement's ``phase``
    ("local": its kernels, before any collective; "exchange": the attention
    under an exchange in flight): the calibration every rank uses, the
    warnings it gave, and the seconds it took; the call itself still exact."""
    mesh, rank = _mesh(), dist.get_rank()
    fake = _FailingSdpa(_FAILURES[failure](), armed=phase == "local")
    real_f, real_rates = microbench.F, microbench._exchange_rates

    def arm_then_exchange(*args):
        fake.armed = True
        return real_rates(*args)
    if rank == bad_rank:
        microbench.F = fake
        microbench._exchange_rates = arm_then_exchange
    choice_mod.clear_caches()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            start = time.monotonic()
            _ring_auto(mesh, *_inputs(mesh.size(), 80), True, f"{failure} in {phase}")
            seconds = time.monotonic() - start
        (cal,) = choice_mod._calibrations.values()
        said = [str(w.message) for w in caught if "calibration" in str(w.message)]
        return cal.name, said, seconds
    finally:
        microbench.F, microbench._exchange_rates = real_f, real_rates
        choice_mod.clear_caches()


@pytest.mark.parametrize("bad_rank,failure,phase", [(1, "exception", "local"),
                                                    (0, "oom", "local"),
                                                    (1, "oom", "exchange")])
def test_calibration_failure_on_one_rank_falls_back_on_every_rank(ranks, bad_rank, failure,
                                                                 phase):
    per_rank = ranks(2).run(_calibrate_failing, bad_rank, failure, phase)
    names = {name for name, _, _ in per_rank}
    assert names == {"cpu (2-core development machine, gloo loopback), after a failed "
                     "measurement"}, names
    said = [warned for _, warned, _ in per_rank]
    assert said[0] == said[1] and len(said[0]) == 1, said
    cls = "OutOfMemoryError" if failure == "oom" else "RuntimeError"
    assert f"failed (rank {bad_rank}: {cls}: " in said[0][0], said[0][0]
    assert "built-in calibration 'cpu'" in said[0][0], said[0][0]
    assert all(seconds < 60 for _, _, seconds in per_rank), per_rank


# ---------------------------------------------------------------- bad input


def _measured_calls() -> tuple[list, object]:
    """Counts the calibration measurements of this rank (microbench.measure)."""
    calls: list = []
    real = microbench.measure

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)
    microbench.measure = counting
    return calls, real


def _bad_auto(case: str) -> tuple[str, str, float, int]:
    """One bad use of auto on this rank or every rank: (exception class,
    message, seconds, measurements made)."""
    mesh, rank, n = _mesh(), dist.get_rank(), dist.get_world_size()
    x = global_tensor((1, 4, 16 * n, 8), torch.float64, 90)
    shape = cplib.AttentionShape(q_heads=4, head_dim=8, dtype=torch.float64)
    limit = 1 if case != "memory-one-rank" or rank == 1 else None
    calls, real = _measured_calls()
    choice_mod.clear_caches()
    start = time.monotonic()
    try:
        if case == "memory-entry":  # chosen on entry (the attention's shape given)
            with cplib.context_parallel(mesh, buffers=[x.clone()], buffer_seq_dims=[2],
                                        strategy=cplib.AutoStrategy(memory_limit=limit,
                                                                    attention=shape)):
                pass
        elif case in ("memory-call", "memory-one-rank"):  # chosen at the SDPA call
            buf = x.clone()
            with cplib.context_parallel(mesh, buffers=[buf], buffer_seq_dims=[2],
                                        strategy=cplib.AutoStrategy(memory_limit=limit)):
                F.scaled_dot_product_attention(buf, buf, buf, is_causal=True)
        elif case == "style-one-rank":  # an unknown value on rank 1 only
            style = cplib._ContextParallel(
                seq_dim=2, attention_type=cplib._ContextParallel.AttentionType.SDPA,
                strategy="fastest" if rank == 1 else "auto")
            parallelize_module(torch.nn.Identity(), mesh, style)
        else:  # "style-every-rank"
            parallelize_module(torch.nn.Identity(), mesh, cplib._ContextParallel(
                seq_dim=2, attention_type=cplib._ContextParallel.AttentionType.SDPA,
                strategy=cplib.AutoStrategy(memory_limit=-5)))
        return "no error", "", time.monotonic() - start, len(calls)
    except Exception as exc:  # the outcome is what the test checks
        return type(exc).__name__, str(exc), time.monotonic() - start, len(calls)
    finally:
        microbench.measure = real
        choice_mod.clear_caches()


@pytest.mark.parametrize("case,text", [
    ("memory-entry", "no candidate fits memory_limit=1 bytes per rank"),
    ("memory-call", "no candidate fits memory_limit=1 bytes per rank"),
    ("memory-one-rank", "invalid input on rank 1: cplib.strategy: no candidate fits "
                        "memory_limit=1 bytes"),
    ("style-one-rank", "invalid input on rank 1: cplib._ContextParallel: strategy='fastest'"),
    ("style-every-rank", "memory_limit=-5"),
])
def test_bad_auto_input_raises_on_every_rank_before_calibrating(ranks, case, text):
    per_rank = ranks(2).run(_bad_auto, case)
    for rank, (cls, msg, seconds, measured) in enumerate(per_rank):
        assert cls == "ValueError", f"rank {rank}: {cls}: {msg}"
        assert text in msg, f"rank {rank}: {msg!r} lacks {text!r}"
        assert measured == 0, f"rank {rank} measured the calibration first"
        assert seconds < _QUICK_S, f"rank {rank} took {seconds:.1f} s"
    assert per_rank[0][1] == per_rank[1][1], per_rank
