"""The handshake's own host cost at S=64, N=2 gloo ranks (B=1 H=8 D=64 fp32):
ATen calls (profiler) and CPU time of one handshake alone, and the ring's
fwd+bwd (causal, head-tail, p2p) CPU time with the handshake on and off,
alternating call by call; medians over ITERS calls.

    .venv/bin/python benchmarks/bench_handshake_cpu.py
"""

from __future__ import annotations

import datetime
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

B, H, S, D, N = 1, 8, 64, 64, 2
ITERS = int(os.environ.get("CPLIB_BENCH_ITERS", "200"))


def _aten_calls(fn) -> tuple[int, dict[str, int]]:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    names: dict[str, int] = {}
    for e in prof.events():
        if e.name.startswith("aten::"):
            names[e.name] = names.get(e.name, 0) + 1
    return sum(names.values()), names


def _rank(rank: int, port: int, out) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=N,
                            timeout=datetime.timedelta(seconds=60))
    import cplib
    from cplib.comm.native import ops
    name = dist.group.WORLD.group_name
    torch.manual_seed(rank)
    q, k, v = (torch.randn(B, H, S // N, D, requires_grad=True) for _ in range(3))
    # One handshake as the ring's forward makes it: three tensors and a few fields.
    hs = lambda: ops.handshake(name, "bench", [q, k, v], ["q", "k", "v"],  # noqa: E731
                               ["is_causal", "rotate"], [1, 0], [S // N, S // N])
    for _ in range(20):
        hs()
    count, names = _aten_calls(hs)
    alone = []
    for _ in range(ITERS):
        dist.barrier()
        c0 = time.process_time()
        hs()
        alone.append(time.process_time() - c0)

    def step():
        out, _ = cplib.ring_sdpa(q, k, v, dist.group.WORLD, is_causal=True, load_balanced=True)
        out.sum().backward()

    for _ in range(5):
        step()
    counter = getattr(ops, "handshake_debug_count", None)
    per_step = None
    if counter is not None:
        try:
            counter(True)
            step()
            per_step = counter(False)
        except (AttributeError, RuntimeError):
            per_step = None
    ring = {"on": [], "off": []}
    for i in range(2 * (ITERS // 2)):
        mode = "on" if i % 2 == 0 else "off"
        with cplib.consistency_checks(mode == "on"):
            dist.barrier()
            c0 = time.process_time()
            step()
            ring[mode].append(time.process_time() - c0)
    med = statistics.median
    out.put((rank, count, names, med(alone), med(ring["on"]), med(ring["off"]), per_step))
    dist.destroy_process_group()


def main() -> None:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(N)]
    for p in procs:
        p.start()
    rows = sorted(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    for rank, count, names, alone, on, off, per_step in rows:
        top = ", ".join(f"{k[6:]} {v}" for k, v in sorted(names.items(), key=lambda x: -x[1]))
        print(f"rank {rank}: one handshake: {count} ATen calls ({top}); CPU {alone * 1e6:.0f} us"
              f"; ring fwd+bwd CPU: on {on * 1e3:.3f} ms, off {off * 1e3:.3f} ms "
              f"(difference {(on - off) * 1e6:.0f} us); handshakes per fwd+bwd: "
              f"{'?' if per_step is None else per_step}")
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, {ITERS} calls, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", file=sys.stderr)


if __name__ == "__main__":
    main()
