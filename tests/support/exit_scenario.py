"""Failing calls, then a clean shutdown, on two gloo processes: the scenario
of tests/comm/test_exit_clean.py and of tests/comm/exit_stress.py.

Each process (a plain subprocess, so that its exit code and stderr are the
caller's to read) runs ``rounds`` rounds of: init_process_group, calls that
end in a clear error on both ranks (one rank's bad argument, shard lengths
that are not the load balancer's layout), a valid ring call, a last failing
call, an all-reduce of the program's own, destroy_process_group. With
``bad_input``, one more init then runs every two-rank case of
the bad-input matrix (tests/support/bad_input.py), each on a fresh group, before its
all-reduce and destroy_process_group. With ``cases`` (names of two-rank
cases of that matrix), one more init runs just those, on its default group, as
a program that meets one error and exits does (issue 53's sweep: one bad
input per pair of processes). Rank 1 exits right after; rank 0 a second
later.

The garbage collector is off (unless ``collector``), so that only
references decide what destroy_process_group() frees: after each, the
process reports how many of the group objects alive before it (the round's,
and any its calls made) are still alive and
how many gloo worker threads ("pt_gloo_runloop") remain. A gloo group that
outlives it keeps its workers, and a worker that drops its last
collective's tensors after the interpreter began to finalize asks for the
GIL, is ended by Python (pthread_exit) inside a noexcept destructor, and
the process aborts: "terminate called without an active exception"
(issue 40).

Run as a script: ``python exit_scenario.py RANK PORT ROUNDS [bad-input] [collector]
[case=NAME ...]``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import Sequence

_HERE = os.path.dirname(os.path.abspath(__file__))
_WORKER_THREAD = "pt_gloo_runloop"  # torch's name for a ProcessGroupGloo worker


@dataclass
class RankResult:
    rank: int
    returncode: int | None  # None: killed at the time limit
    out: str
    err: str

    @property
    def aborted(self) -> bool:
        return "terminate called" in self.err or self.returncode in (-6, 134)

    def lines(self, kind: str) -> list[list[str]]:
        """The ``kind|...`` lines this rank printed, split at ``|``."""
        return [line.split("|")[1:] for line in self.out.splitlines()
                if line.startswith(kind + "|")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pair(import_root: str, rounds: int, bad_input: bool = False, collector: bool = False,
             cwd: str | None = None, timeout_s: float = 240.0,
             cases: Sequence[str] = ()) -> list[RankResult]:
    """Runs the scenario on two processes that import cplib from
    ``import_root``; their results in rank order. ``collector``: the garbage
    collector stays on, as in a program (a group kept by a cycle is then
    freed whenever it runs: at exit, say). ``cases``: bad-input cases to run
    last, by name, on the default group of one init."""
    args = [str(rounds)] + (["bad-input"] if bad_input else []) + \
        (["collector"] if collector else []) + [f"case={name}" for name in cases]
    for _ in range(3):
        results = _run_pair_once(import_root, args, cwd, timeout_s)
        # The port free_port() found was taken before rank 0 listened on it
        # (another job's): the pair never started; run it on another one.
        if not any("EADDRINUSE" in r.err for r in results):
            break
    return results


def _run_pair_once(import_root: str, args: list[str], cwd: str | None,
                   timeout_s: float) -> list[RankResult]:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([import_root, os.environ.get("PYTHONPATH", "")]))
    args = [str(free_port())] + args
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), str(rank)] + args,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                              cwd=cwd)  # not the source tree, whose cplib has no _C
             for rank in range(2)]
    results = []
    try:
        for rank, p in enumerate(procs):
            try:
                out, err = p.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
                results.append(RankResult(rank, None, out, err))
                continue
            results.append(RankResult(rank, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


# ---------------------------------------------------------------- in each process


def _gloo_workers() -> int:
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:  # not Linux: the group count still tells
        return -1
    count = 0
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                count += f.read().strip() == _WORKER_THREAD
        except OSError:  # the thread ended meanwhile
            pass
    return count


def _raises(call) -> str:
    try:
        call()
    except Exception as exc:  # the error is the point; its class and text are checked
        return type(exc).__name__ + ": " + str(exc)
    return "no error"


def _round(i: int, rank: int) -> list:
    """One round's calls on the default group; the groups it used."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    import cplib
    from cplib.ring.load_balancer import _HeadTailLoadBalancer

    g = dist.group.WORLD
    q = torch.randn(1, 2, 8, 4)
    mesh = DeviceMesh.from_group(g, "cpu")
    bad_scale = _raises(lambda: cplib.ring_sdpa(q, q, q, g, scale=float("nan") if rank else None))
    bad_lengths = _raises(lambda: cplib.unshard(mesh, [torch.randn(1, 8 - 2 * rank)], [1],
                                                _HeadTailLoadBalancer(16, 2, "cpu")))
    out, _ = cplib.ring_sdpa(q, q, q, g, is_causal=True, rotate=("p2p", "allgather")[i % 2])
    last = _raises(lambda: cplib.ring_sdpa(q, q, q, g, window=-1 if rank else 2))
    print(f"round|{i}|{bad_scale}|{bad_lengths}|{tuple(out.shape)}|{last}", flush=True)
    return [g]


def _bad_input_cases(rank: int, names: Sequence[str] = ()) -> list:
    """Every two-rank case of the bad-input matrix, each on a fresh group;
    or the ``names`` cases, on the default group."""
    import bad_input
    import torch.distributed as dist

    groups = []
    for name, world, case, exc_type, _ in bad_input.CASES:
        if world != 2 or (names and name not in names):
            continue
        g = dist.group.WORLD if names else dist.new_group([0, 1])
        groups.append(g)
        outcome = _raises(lambda: case(rank, g))
        print(f"case|{name}|{outcome.split(':')[0]}|{exc_type.__name__}", flush=True)
    return groups


def main(rank: int, port: int, rounds: int, bad_input: bool, collector: bool,
         cases: Sequence[str] = ()) -> None:
    import datetime
    import gc
    import time
    import weakref

    import torch
    import torch.distributed as dist

    # Imported before any group exists, as a program does: importing cplib
    # imports torch._dynamo, and with it torch.distributed.nn, whose
    # functions keep the default group of that moment as a default argument.
    import cplib  # noqa: F401
    import bad_input as matrix  # noqa: F401  (imports cplib's features as its cases use them)

    if not collector:
        gc.disable()  # what references keep, not when the collector runs
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
    steps = [_round] * rounds + ([lambda i, r: _bad_input_cases(r)] if bad_input else []) + \
        ([lambda i, r: _bad_input_cases(r, cases)] if cases else [])
    for i, step in enumerate(steps):
        dist.init_process_group("gloo", rank=rank, world_size=2,
                                store=dist.PrefixStore(f"round{i}", store),
                                timeout=datetime.timedelta(seconds=15))
        used = step(i, rank)
        dist.all_reduce(torch.ones(8))  # the program's own last collective (a loss, say)
        # Every live group, those the calls made for themselves (USP's, a
        # second group over the same ranks) too.
        live = {id(g): g for g in [*used, *dist.distributed_c10d._world.pg_names]}
        refs = [weakref.ref(g) for g in live.values()]
        del used, live
        dist.destroy_process_group()
        alive = sum(ref() is not None for ref in refs)
        # Reading /proc gives a late worker time to finish (it lets go of the
        # GIL): left out where the exit's race is the point.
        print(f"destroyed|{i}|{alive}|{'-' if collector else _gloo_workers()}", flush=True)
    if rank == 0:
        time.sleep(1)  # the ranks leave at different times


if __name__ == "__main__":
    sys.path[:0] = [_HERE, os.path.join(os.path.dirname(_HERE), "comm")]
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), "bad-input" in sys.argv[4:],
         "collector" in sys.argv[4:],
         [a.partition("=")[2] for a in sys.argv[4:] if a.startswith("case=")])
