"""Failing calls, then a clean shutdown: no abort at interpreter exit.

Two gloo processes (plain subprocesses, so that their exit codes and stderr
are this test's to read) run 20 rounds of: init_process_group, calls that
end in a clear error on both ranks (one rank's bad argument, shard lengths
that are not the load balancer's layout), a valid ring call, then
destroy_process_group. The last round's last call comes right before the
interpreter exits. Both processes must print every round's errors and exit 0
without "terminate called" (the SIGABRT issue 31 saw after
destroy_process_group, during interpreter shutdown)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

from harness import cplib_import_root

_ROUNDS = 20

_RANK = textwrap.dedent('''
    import datetime, sys
    import torch, torch.distributed as dist
    import cplib
    from cplib.ring.load_balancer import _HeadTailLoadBalancer
    from torch.distributed.device_mesh import DeviceMesh

    rank, port, rounds = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0,
                          timeout=datetime.timedelta(seconds=30))

    def raises(call):
        try:
            call()
        except Exception as exc:  # the error is the point; its class and text are checked
            return type(exc).__name__ + ": " + str(exc)
        return "no error"

    for i in range(rounds):
        dist.init_process_group("gloo", rank=rank, world_size=2,
                                store=dist.PrefixStore(f"round{i}", store),
                                timeout=datetime.timedelta(seconds=15))
        g = dist.group.WORLD
        q = torch.randn(1, 2, 8, 4)
        mesh = DeviceMesh.from_group(g, "cpu")
        bad_scale = raises(lambda: cplib.ring_sdpa(q, q, q, g,
                                                    scale=float("nan") if rank else None))
        bad_lengths = raises(lambda: cplib.unshard(mesh, [torch.randn(1, 8 - 2 * rank)], [1],
                                                   _HeadTailLoadBalancer(16, 2, "cpu")))
        out, _ = cplib.ring_sdpa(q, q, q, g, is_causal=True, rotate=("p2p", "allgather")[i % 2])
        last = raises(lambda: cplib.ring_sdpa(q, q, q, g, window=-1 if rank else 2))
        print(f"round {i}|{bad_scale}|{bad_lengths}|{tuple(out.shape)}|{last}", flush=True)
        del mesh, g
        dist.destroy_process_group()
''')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_failing_calls_then_clean_exit(tmp_path):
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=cplib_import_root() + os.pathsep +
               os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(rank), str(port), str(_ROUNDS)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                              cwd=tmp_path)  # not the source tree, whose cplib has no _C
             for rank in range(2)]
    try:
        results = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, (out, err)) in enumerate(zip(procs, results)):
        assert "terminate called" not in err, f"rank {rank} aborted:\n{err[-3000:]}"
        assert p.returncode == 0, f"rank {rank} exited with {p.returncode}:\n{err[-3000:]}"
        rounds = [line.split("|") for line in out.splitlines() if line.startswith("round ")]
        assert len(rounds) == _ROUNDS, f"rank {rank} finished {len(rounds)} rounds:\n{out}{err}"
        for _, bad_scale, bad_lengths, shape, last in rounds:
            assert bad_scale.startswith("ValueError: ") and "scale=nan" in bad_scale, bad_scale
            assert bad_lengths.startswith("ValueError: ") and \
                "lengths [8, 6] along seq_dim 1" in bad_lengths, bad_lengths
            assert shape == "(1, 2, 8, 4)", shape
            assert last.startswith("ValueError: ") and "window=-1" in last, last
