"""The ring's host work at S=64 (issue 29; docs/ring.md, "Host work"): at this size
the kernels cost nothing, so one fwd+bwd of cplib.ring_sdpa is pure host
work, the work that leaves a GPU idle between kernels. Per fwd+bwd on rank 0
of 2 gloo ranks (B=1 H=8 S=64 D=64 fp32, causal, head-tail, p2p, default
settings), against torch's _templated_ring_attention (+ _backward, all-to-all
rotation, the same CPU flash kernel) on the same shards:

- ATen calls outside the attention kernels: the profiler's ``aten::`` events
  (nested ones count too: one ``narrow`` shows as narrow, slice, as_strided)
  that are neither an attention kernel's event nor nested under one;
- collectives: the ``_c10d_functional`` collective events (wait_tensor and
  _wrap_tensor_autograd aside);
- CPU time (``time.process_time``, every thread of the process) per fwd+bwd,
  cplib and torch alternating call by call, median of ``CPLIB_BENCH_ITERS``
  (default 80) calls each.

cplib is measured with its handshake on (the default) and off
(``CPLIB_CHECK_CONSISTENCY=0``), so the handshake's share shows apart.

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
ITERS = int(os.environ.get("CPLIB_BENCH_ITERS", "80"))
KERNELS = ("aten::_scaled_dot_product_flash_attention_for_cpu",
           "aten::_scaled_dot_product_flash_attention_for_cpu_backward")
_ENV = "CPLIB_CHECK_CONSISTENCY"
_NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd")


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
    collectives = Counter(e.name for e in events if e.name.startswith("_c10d_functional::")
                          and e.name.split("::")[1] not in _NOT_COLLECTIVES)
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
    rank = dist.get_rank()
    q, k, v, grad_out = inputs(rank, dist.get_world_size())
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    steps = {
        "cplib": lambda: cplib_step(qg, kg, vg, grad_out),
        "cplib, no handshake": lambda: cplib_step(qg, kg, vg, grad_out),
        "torch": lambda: torch_step(q, k, v, grad_out),
    }
    handshake = {"cplib": True, "cplib, no handshake": False, "torch": True}
    result = {"counts": {}, "cpu_s": {}}
    for name, step in steps.items():
        _set_handshake(handshake[name])
        for _ in range(3):  # warm-up: lazy library state is not the ring's
            step()
        dist.barrier()
        result["counts"][name] = host_counts(step)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(iters):
        for name, step in steps.items():  # alternating call by call
            _set_handshake(handshake[name])
            dist.barrier()
            t0 = time.process_time()
            step()
            times[name].append(time.process_time() - t0)
    _set_handshake(True)
    result["cpu_s"] = {name: statistics.median(ts) for name, ts in times.items()}
    return result


def main() -> None:
    per_rank = run_on_ranks(N, _rank, ITERS)
    r0 = per_rank[0]
    torch_cpu = max(r["cpu_s"]["torch"] for r in per_rank)
    rows = []
    for name in ("cplib", "cplib, no handshake", "torch"):
        c = r0["counts"][name]
        cpu = max(r["cpu_s"][name] for r in per_rank)
        rows.append((name, c["aten"], c["collectives"], c["kernels"], cpu * 1e3,
                     cpu / torch_cpu))
    print_table(f"Ring host work per fwd+bwd, S={S}, N={N} (rank 0 counts; CPU time: the "
                f"slower rank's median of {ITERS}, alternating)",
                ["impl", "ATen calls outside kernels", "collectives", "attention kernels",
                 "CPU ms", "vs torch"], rows)
    for name in ("cplib", "cplib, no handshake", "torch"):
        c = r0["counts"][name]
        print(f"\n{name}: collectives {c['collectives_by_name']}, cplib_c ops {c['cplib_ops']}")
        print(f"{name}: ATen calls by name {c['aten_by_name']}")
    write_json("bench_ring_host", {"shape": [B, H, S, D], "world": N, "iters": ITERS,
                                   "per_rank": per_rank})
    names = [r[0] for r in rows]
    plot("bench_ring_host", f"Ring host work per fwd+bwd (S={S}, N={N}, gloo)", "impl",
         "count / CPU us",
         {"ATen calls": (names, [r[1] for r in rows]),
          "CPU us / 10": (names, [r[4] * 100 for r in rows])}, kind="bar")
    print(f"\n{machine()}")


if __name__ == "__main__":
    main()
