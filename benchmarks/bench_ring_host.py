"""The ring's host work at S=64 (issue 29, issue 44; docs/ring.md, "Host work"): at
this size the kernels cost nothing, so one fwd+bwd of ring attention is pure
host work, the work that leaves a GPU idle between kernels. Per fwd+bwd on 2
gloo ranks (B=1 H=8 S=64 D=64 fp32, causal, head-tail, p2p, default
settings), against torch's _templated_ring_attention (+ _backward, all-to-all
rotation, the same CPU flash kernel) on the same shards. cplib runs three
ways:

- "cplib": ``cplib.ring_sdpa`` and ``torch.autograd.grad``;
- "cplib, no handshake": the same with ``CPLIB_CHECK_CONSISTENCY=0``, so the
  handshake's share shows apart;
- "cplib, F.sdpa under context_parallel": the path users take,
  ``F.scaled_dot_product_attention`` inside ``cplib.context_parallel`` (its
  SDPA routing, the autograd formula) and ``torch.autograd.grad``; the goal
  (issue 44) is at most 0.75x torch's CPU. The context is entered once (its
  handshake and groups, as a training step enters it around many layers);
  each call runs inside its dispatch mode, entered per call (a few us,
  counted against cplib), and the other implementations outside it.

Measured per fwd+bwd:

- ATen calls outside the attention kernels: the profiler's ``aten::`` events
  (nested ones count too: one ``narrow`` shows as narrow, slice, as_strided)
  that are neither an attention kernel's event nor nested under one (rank 0);
- collectives: the native layer's (``cplib_c::c10d_*``: each one call of the
  group's) or torch's functional ones (``_c10d_functional::*``, waits aside);
- CPU time: ``time.process_time`` (every thread of the process: gloo's
  transport threads too) and ``time.thread_time`` (the calling thread), the
  implementations alternating call by call, ``CPLIB_BENCH_ITERS`` (default
  200) rounds of one call each, in ``CPLIB_BENCH_REPEATS`` (default 3) fresh
  runs. "vs torch" is the median over rounds of the round's CPU time over
  torch's in the same round (paired: a loaded machine's drift cancels), on
  the slower rank; the table shows each run's and their median, and the
  same for the calling thread alone. gloo's transport thread
  (``gloo_tcp_loop``) polls while a message waits for its receiver, so its
  share of the process's CPU follows how far apart the ranks run (0.3 to
  1.5 ms per fwd+bwd here, for cplib's four collectives and torch's four
  alike): the calling thread's figure is the steadier one.

    python benchmarks/bench_ring_host.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections import Counter

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from common import machine, plot, print_table, run_on_ranks, write_json  # noqa: E402

B, H, S, D, N = 1, 8, 64, 64, 2
ITERS = int(os.environ.get("CPLIB_BENCH_ITERS", "200"))
REPEATS = int(os.environ.get("CPLIB_BENCH_REPEATS", "3"))
KERNELS = ("aten::_scaled_dot_product_flash_attention_for_cpu",
           "aten::_scaled_dot_product_flash_attention_for_cpu_backward")
_ENV = "CPLIB_CHECK_CONSISTENCY"
_NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd")
SDPA = "cplib, F.sdpa under context_parallel"
# The same in a region that holds buffers (ids, labels: a training step's),
# whose saved-tensor hooks are active around every call.
BUFFERS = "cplib, F.sdpa in a region with buffers"
IMPLS = ("cplib", "cplib, no handshake", SDPA, BUFFERS, "torch")
GOAL = 0.75  # SDPA's CPU over torch's (issue 44)


def inputs(rank: int, n: int) -> tuple[torch.Tensor, ...]:
    """This rank's head-tail shards of q, k, v and of a gradient of the output."""
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(B, H, S, D, generator=g) for _ in range(4)]

    def shard(t):
        c = t.chunk(2 * n, dim=2)
        return torch.cat([c[rank], c[2 * n - 1 - rank]], dim=2).contiguous()
    return tuple(shard(t) for t in full)


def cplib_step(q, k, v, grad_out):
    import cplib
    out, _ = cplib.ring_sdpa(q, k, v, dist.group.WORLD, is_causal=True, load_balanced=True)
    return torch.autograd.grad(out, (q, k, v), grad_out)


def sdpa_step(q, k, v, grad_out):
    """The path users take: F.scaled_dot_product_attention inside an entered
    ``cplib.context_parallel`` (head-tail shards), fwd+bwd through autograd."""
    import torch.nn.functional as F
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return torch.autograd.grad(out, (q, k, v), grad_out)


def torch_step(q, k, v, grad_out):
    from torch.distributed.tensor.experimental._context_parallel import _attention as A
    A._cp_options.enable_load_balance = True  # head-tail shards, as cplib's
    A._cp_options.rotate_method = A._RotateMethod.ALL_TO_ALL
    aten = torch.ops.aten
    with torch.no_grad():
        out, lse, *_ = A._templated_ring_attention(
            dist.group.WORLD, 2, aten._scaled_dot_product_flash_attention_for_cpu, q, k, v,
            is_causal=True)
        return A._templated_ring_attention_backward(
            dist.group.WORLD, 2, aten._scaled_dot_product_flash_attention_for_cpu_backward,
            grad_out, "grad_out", q, k, v, out, lse, True, dropout_p=0.0)


def _under_kernel(e) -> bool:
    while e is not None:
        if e.name in KERNELS:
            return True
        e = e.cpu_parent
    return False


def host_counts(step) -> dict:
    """ATen calls outside the attention kernels, collectives and the
    Python-implemented cplib_c ops of one call of ``step`` (profiled)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = prof.events()
    aten = Counter(e.name for e in events
                   if e.name.startswith("aten::") and not _under_kernel(e))
    kernels = sum(1 for e in events if e.name in KERNELS)
    collectives = Counter(e.name for e in events if e.name.startswith("cplib_c::c10d_") or (
        e.name.startswith("_c10d_functional::") and e.name.split("::")[1] not in _NOT_COLLECTIVES))
    cplib_ops = Counter(e.name for e in events if e.name.startswith(("cplib_c::", "c10d::")))
    return dict(aten=sum(aten.values()), aten_by_name=dict(aten.most_common()),
                kernels=kernels, collectives=sum(collectives.values()),
                collectives_by_name=dict(collectives), cplib_ops=dict(cplib_ops))


def _set_handshake(on: bool) -> None:
    if on:
        os.environ.pop(_ENV, None)
    else:
        os.environ[_ENV] = "0"


def _rank(iters: int) -> dict:
    import cplib
    from cplib.frontend.sdpa_dispatch import CPDispatchMode
    from cplib.frontend.sharding import keep_shards_for_backward
    from torch.distributed.device_mesh import init_device_mesh

    q, k, v, grad_out = inputs(dist.get_rank(), dist.get_world_size())
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    # The context's SDPA routing, as cplib.context_parallel(mesh, load_balance=True)
    # sets it up once (its handshake, its groups); each SDPA step runs inside
    # its dispatch mode (entering it costs a few us, counted against cplib), the
    # other steps outside it, as a program calls them.
    with cplib.context_parallel(mesh, load_balance=True) as handle:
        pass

    def routed():
        with CPDispatchMode(handle.config, handle):
            return sdpa_step(qg, kg, vg, grad_out)

    ids = torch.zeros(1, S, dtype=torch.long)  # a buffer the region holds sharded
    shard = ids[:, : S // dist.get_world_size()].clone()

    def routed_with_buffers():
        # In the region's order: the hooks, then the dispatch.
        with keep_shards_for_backward([shard]), CPDispatchMode(handle.config, handle, (ids,)):
            return sdpa_step(qg, kg, vg, grad_out)

    steps = {
        "cplib": lambda: cplib_step(qg, kg, vg, grad_out),
        "cplib, no handshake": lambda: cplib_step(qg, kg, vg, grad_out),
        SDPA: routed,
        BUFFERS: routed_with_buffers,
        "torch": lambda: torch_step(q, k, v, grad_out),
    }
    handshake = {name: name != "cplib, no handshake" for name in steps}
    result = {"counts": {}}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in steps}
    for name, step in steps.items():
        _set_handshake(handshake[name])
        for _ in range(3):  # warm-up: lazy library state is not the ring's
            step()
        dist.barrier()
        result["counts"][name] = host_counts(step)
    for _ in range(iters):
        for name, step in steps.items():  # alternating call by call
            _set_handshake(handshake[name])
            dist.barrier()
            p0, t0 = time.process_time(), time.thread_time()
            step()
            times[name].append((time.process_time() - p0, time.thread_time() - t0))
    _set_handshake(True)
    base = times["torch"]
    result["cpu_s"] = {n: statistics.median(p for p, _ in ts) for n, ts in times.items()}
    result["thread_s"] = {n: statistics.median(t for _, t in ts) for n, ts in times.items()}
    result["vs_torch"] = {n: statistics.median(p / b[0] for (p, _), b in zip(ts, base))
                          for n, ts in times.items()}
    result["thread_vs_torch"] = {n: statistics.median(t / b[1] for (_, t), b in zip(ts, base))
                                 for n, ts in times.items()}
    return result


def main() -> None:
    runs = [run_on_ranks(N, _rank, ITERS) for _ in range(REPEATS)]
    counts = runs[0][0]["counts"]
    rows = []
    for name in IMPLS:
        c = counts[name]
        # The slower rank of each run.
        ratios = [max(r["vs_torch"][name] for r in run) for run in runs]
        thread_ratio = statistics.median(max(r["thread_vs_torch"][name] for r in run)
                                         for run in runs)
        cpu = statistics.median(max(r["cpu_s"][name] for r in run) for run in runs)
        thread = statistics.median(max(r["thread_s"][name] for r in run) for run in runs)
        rows.append((name, c["aten"], c["collectives"], c["kernels"], cpu * 1e3, thread * 1e3,
                     thread_ratio, " / ".join(f"{x:.3f}" for x in ratios),
                     statistics.median(ratios)))
    print_table(f"Ring host work per fwd+bwd, S={S}, N={N} (rank 0 counts; CPU: the slower "
                f"rank's median of {ITERS} alternating rounds, median of {REPEATS} runs)",
                ["impl", "ATen calls outside kernels", "collectives", "attention kernels",
                 "CPU ms", "calling thread ms", "calling thread vs torch",
                 "vs torch, each run", "vs torch"], rows)
    for name in (SDPA, BUFFERS):
        ratio = rows[IMPLS.index(name)][-1]
        print(f"\n{name} / torch's ring: {ratio:.3f} "
              f"(goal <= {GOAL}: {'met' if ratio <= GOAL else 'NOT met'})")
    for name in IMPLS:
        c = counts[name]
        print(f"\n{name}: collectives {c['collectives_by_name']}, cplib_c ops {c['cplib_ops']}")
        print(f"{name}: ATen calls by name {c['aten_by_name']}")
    write_json("bench_ring_host", {"shape": [B, H, S, D], "world": N, "iters": ITERS,
                                   "repeats": REPEATS, "runs": runs, "goal": GOAL})
    names = [r[0] for r in rows]
    plot("bench_ring_host", f"Ring host work per fwd+bwd (S={S}, N={N}, gloo)", "impl",
         "count / CPU us",
         {"ATen calls": (names, [r[1] for r in rows]),
          "CPU us / 10": (names, [r[4] * 100 for r in rows]),
          "vs torch x 100": (names, [r[-1] * 100 for r in rows])}, kind="bar")
    print(f"\n{machine()}")


if __name__ == "__main__":
    main()
