"""Multi-rank test harness.

``RankPool`` keeps ``world_size`` gloo ranks alive (one process and one
intra-op thread each) so that many checks share one spawn; ``run`` sends a
module-level function to every rank and re-raises each failing rank's
traceback. ``run_threaded`` runs the same kind of body on a threaded process
group (all ranks in this process), which is how GPU checks run on one GPU.
``compare_with_reference`` checks a sharded computation against the same
computation on the full data.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import queue
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from pool_groups import destroy_groups_made_since, groups

RANK_TIMEOUT_S = float(os.environ.get("CPLIB_TEST_RANK_TIMEOUT", "90"))
RUN_TIMEOUT_S = float(os.environ.get("CPLIB_TEST_RUN_TIMEOUT", "900"))
FAILURE_GRACE_S = float(os.environ.get("CPLIB_TEST_FAILURE_GRACE", "10"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _format_failures(failures: Sequence[tuple[int, str]]) -> str:
    return "\n".join(f"--- rank {r} failed ---\n{tb}" for r, tb in sorted(failures))


def _restore_process_state() -> None:
    """Undoes what a task may have switched for its own checks, so that the
    next task on these pooled ranks starts as a fresh process would: the
    reference ring (tests/support/cp_reference.py) goes back to the native op,
    the context-parallel options to their defaults."""
    reference = sys.modules.get("cp_reference")
    if reference is not None:
        reference.restore_native_ring()
    options = sys.modules.get("cplib.frontend.options")
    if options is not None:  # the rotation, the last shard's layout, ...
        fresh = options._ContextParallelOptions()
        for field in dataclasses.fields(fresh):
            setattr(options._cp_options, field.name, getattr(fresh, field.name))


def _worker(rank: int, world_size: int, port: int, tasks, results,
            timeout_s: float = RANK_TIMEOUT_S) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        while True:
            task = tasks.get()
            if task is None:
                break
            task_id, fn, args, kwargs = task
            before = groups()
            try:
                results.put((task_id, rank, True, fn(*args, **kwargs)))
            except BaseException:  # report everything; the pool respawns after a failure
                results.put((task_id, rank, False, traceback.format_exc()))
            finally:
                _restore_process_state()
                destroy_groups_made_since(before)
    finally:
        dist.destroy_process_group()


class RankPool:
    """``world_size`` persistent gloo ranks on loopback.

    Each task carries an id and results of any other id are discarded, so a
    late answer from an earlier task can never be read as this one's. After a
    failure or a timeout the pool closes itself (ranks may be stuck in a
    collective, or hold state the failure left behind) and the next ``run``
    of the fixture gets fresh ranks: one failing test cannot change another's
    result."""

    def __init__(self, world_size: int, timeout_s: float = RANK_TIMEOUT_S):
        """``timeout_s``: the process groups' timeout (a short one makes a
        collective that never completes fail fast)."""
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._next_id = 0
        self._closed = False
        port = _free_port()
        self._procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, self._tasks[r], self._results,
                                              timeout_s), daemon=True)
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()

    def alive(self) -> bool:
        return not self._closed and all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Runs ``fn(*args, **kwargs)`` on every rank; returns the per-rank
        results, or raises AssertionError with every failing rank's traceback."""
        if not self.alive():
            raise AssertionError("RankPool.run on a closed pool (use the `ranks` fixture, which "
                                 "respawns it)")
        self._next_id += 1
        task_id = self._next_id
        for q in self._tasks:
            q.put((task_id, fn, args, kwargs))
        got: dict[int, Any] = {}
        failures: list[tuple[int, str]] = []
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while len(got) + len(failures) < self.world_size:
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
            try:
                # Short waits, so that a rank process that died is noticed.
                rid, rank, ok, payload = self._results.get(
                    timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() < deadline and not dead:
                    continue
                self.close(force=True)
                missing = sorted(set(range(self.world_size)) - set(got) - {r for r, _ in failures})
                if dead:
                    waited = f"(rank processes {dead} died: exit codes " \
                             f"{[self._procs[r].exitcode for r in dead]})"
                else:
                    waited = "after another rank failed" if failures else f"in {RUN_TIMEOUT_S}s"
                raise AssertionError(
                    f"ranks {missing} did not finish {fn.__name__} {waited} (pool closed, the "
                    "next test gets fresh ranks)\n" + _format_failures(failures)
                ) from None
            if rid != task_id:
                continue  # a stale answer to an earlier task
            if ok:
                got[rank] = payload
            else:
                failures.append((rank, payload))
                # The others get a short grace period from this failure on
                # (not renewed while they wait): they may be blocked in a
                # collective the failed rank never joined.
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        if failures:
            self.close(force=True)
            raise AssertionError(
                f"{fn.__name__} failed on {len(failures)} of {self.world_size} ranks (pool "
                "closed, the next test gets fresh ranks)\n" + _format_failures(failures)
            )
        return [got[r] for r in range(self.world_size)]

    def close(self, force: bool = False) -> None:
        self._closed = True
        for p, q in zip(self._procs, self._tasks):
            if p.is_alive() and not force:
                q.put(None)
        for p in self._procs:
            p.join(timeout=0 if force else 20)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def _threaded_world_can_destroy() -> bool:
    """torch 2.11's threaded world has no ``comms`` list, which
    ``destroy_process_group`` reads; there the world (thread-local) simply
    ends with its rank thread."""
    from torch.testing._internal.distributed.multi_threaded_pg import ThreadLocalWorld

    return hasattr(ThreadLocalWorld, "comms")


def run_threaded(world_size: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
    """Runs ``fn`` on ``world_size`` ranks of a threaded process group inside
    this process (several ranks can then share one GPU)."""
    from torch.testing._internal.distributed.multi_threaded_pg import (
        ProcessLocalGroup,
        _install_threaded_pg,
        _uninstall_threaded_pg,
    )

    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_pg()
    store = dist.HashStore()
    results: list[Any] = [None] * world_size
    failures: list[tuple[int, str]] = []

    def body(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
        try:
            results[rank] = fn(*args, **kwargs)
        except BaseException as exc:
            failures.append((rank, traceback.format_exc()))
            ProcessLocalGroup.exception_handle(exc)  # wake ranks blocked in a collective
        finally:
            if can_destroy:
                dist.destroy_process_group()

    can_destroy = _threaded_world_can_destroy()
    threads = [threading.Thread(target=body, args=(r,)) for r in range(world_size)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(RUN_TIMEOUT_S)
            if t.is_alive():
                failures.append((threads.index(t), f"timed out after {RUN_TIMEOUT_S}s"))
    finally:
        ProcessLocalGroup.reset()
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    if failures:
        raise AssertionError(
            f"{fn.__name__} failed on {len(failures)} of {world_size} threaded ranks\n"
            + _format_failures(failures)
        )
    return results


# ---------------------------------------------------------------- reference checks


def shard(t: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous slice of ``t`` along ``dim`` (sequential layout)."""
    return t.chunk(world_size, dim=dim)[rank]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, atol: float, rtol: float,
                 what: str) -> None:
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol,
                               msg=lambda m: f"{what}: {m}")


def compare_with_reference(
    sharded_fn: Callable[..., Any],
    reference_fn: Callable[..., Any],
    full_inputs: Sequence[torch.Tensor],
    shard_input: Callable[[int, torch.Tensor], torch.Tensor],
    shard_output: Callable[[int, torch.Tensor], torch.Tensor],
    *,
    atol: float,
    rtol: float,
    grad_inputs: Sequence[int] | None = None,
    combine_grad: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Checks a sharded computation against the full one, outputs and gradients.

    ``reference_fn`` runs on the full inputs (in this rank alone), ``sharded_fn``
    on this rank's shards: ``shard_input(i, t)`` is this rank's part of input
    ``i`` and ``shard_output(j, t)`` its part of output ``j``. Gradients of every
    floating input (or of ``grad_inputs``) are compared with the reference's,
    sharded the same way; ``combine_grad(i, g)`` may first reduce a local
    partial gradient (a replicated weight's, say). The same seeded random
    cotangent is used on the full and the sharded side.
    """
    idx = set(range(len(full_inputs)) if grad_inputs is None else grad_inputs)
    full = [t.detach().clone().requires_grad_(i in idx and t.is_floating_point())
            for i, t in enumerate(full_inputs)]
    local = [shard_input(i, t.detach()).clone().requires_grad_(full[i].requires_grad)
             for i, t in enumerate(full_inputs)]
    ref = reference_fn(*full)
    out = sharded_fn(*local)
    ref_t = tuple(ref) if isinstance(ref, (tuple, list)) else (ref,)
    out_t = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    assert len(ref_t) == len(out_t), f"{len(out_t)} sharded outputs vs {len(ref_t)} reference"
    for j, (o, r) in enumerate(zip(out_t, ref_t)):
        assert_close(o, shard_output(j, r.detach()), atol=atol, rtol=rtol, what=f"output {j}")
    if not any(t.requires_grad for t in full):
        return
    gen = torch.Generator().manual_seed(1234)
    cots = [torch.randn(r.shape, generator=gen, dtype=torch.float64).to(r.dtype) for r in ref_t]
    torch.autograd.backward(list(ref_t), cots)
    torch.autograd.backward(list(out_t), [shard_output(j, c) for j, c in enumerate(cots)])
    for i in sorted(idx):
        if not full[i].requires_grad:
            continue
        got = local[i].grad if combine_grad is None else combine_grad(i, local[i].grad)
        assert_close(got, shard_input(i, full[i].grad), atol=atol, rtol=rtol,
                     what=f"grad of input {i}")


def cplib_import_root() -> str:
    """The folder the cplib under test was imported from (the source tree, or
    site-packages for an installed wheel): subprocesses must load that one."""
    import cplib

    return os.path.dirname(os.path.dirname(os.path.abspath(cplib.__file__)))


def rank_info() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


if __name__ == "__main__":  # pragma: no cover
    sys.exit("tests/support/harness.py is a library for the test suite")
