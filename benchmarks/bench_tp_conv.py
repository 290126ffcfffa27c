"""Halo-exchange convolution: per-rank forward+backward time of a 3x3 conv
(64->64 channels, padding 1) on a width-sharded input, at N ranks (gloo, one
thread per rank), against
  - the same conv run locally on the unextended shard (no exchange; the target
    is tp_conv <= 1.15x this),
  - torch's own DTensor ``_tp_conv`` handlers on the same shard (where they run),
  - the single-process convolution of the full input (the ideal per-rank time is
    that divided by N).

Each variant's wall time and this process's CPU time (user + system, all its
threads: the exchange's gloo threads count) are medians over rounds that run
every variant once, in turn, between barriers. On a shared machine the CPU
time is the steadier figure: it leaves out the time a rank waits for a core.
``--pin`` binds rank r to core r (as ``taskset -c r`` would), so the ranks do
not migrate.

  python benchmarks/bench_tp_conv.py [--ranks 2] [--batch 4] [--height 512] [--width 512]
                                     [--iters 5] [--pin]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import (interleaved_wall_cpu, machine, plot, print_table, run_on_ranks, timeit,  # noqa: E402
                    write_json)

NAME = "bench_tp_conv"


def _fwd_bwd(conv):
    def run():
        out = conv()
        out.backward(torch.ones_like(out))
    return run


def _rank_bench(args) -> dict:
    import cplib

    rank, n = dist.get_rank(), dist.get_world_size()
    if args.pin:
        os.sched_setaffinity(0, {rank % os.cpu_count()})
    c, b, h, w_full = args.channels, args.batch, args.height, args.width
    g = torch.Generator().manual_seed(0)
    x_full = torch.randn(b, c, h, w_full, generator=g)
    weight = (torch.randn(c, c, 3, 3, generator=g) * 0.05).requires_grad_(True)
    bias = torch.zeros(c, requires_grad=True)
    x = x_full.chunk(n, -1)[rank].contiguous().requires_grad_(True)
    name = dist.group.WORLD.group_name
    tp = lambda: cplib.tp_conv(x, weight, bias, padding=1, group=name)  # noqa: E731
    local = lambda: F.conv2d(x, weight, bias, padding=1)  # noqa: E731
    fns = {"tp_conv": _fwd_bwd(tp), "local_shard": _fwd_bwd(local),
           "tp_conv_fwd": lambda: tp(), "local_shard_fwd": lambda: local()}
    torch_fwd, torch_note = _torch_dtensor_forward(x_full, weight, bias, n)
    if torch_fwd is not None:
        fns["torch_dtensor_fwd"] = torch_fwd
    row = {"rank": rank, "local_shape": list(x.shape), "torch_dtensor_note": torch_note}
    row.update(interleaved_wall_cpu(fns, args.iters))
    return row


def _torch_dtensor_forward(x_full, weight, bias, n):
    """torch's own DTensor conv handlers (upstream ``_tp_conv``) on the same
    shard: returns (forward fn or None, what happened to forward+backward)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

    mesh = init_device_mesh("cpu", (n,))
    conv = nn.Conv2d(weight.shape[1], weight.shape[0], 3, padding=1)
    with torch.no_grad():
        conv.weight.copy_(weight)
        conv.bias.copy_(bias)
    dconv = distribute_module(conv, mesh)
    x = distribute_tensor(x_full, mesh, [Shard(3)]).detach().requires_grad_(True)
    try:
        dconv(x)
    except Exception as exc:
        return None, f"forward failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    try:
        _fwd_bwd(lambda: dconv(x))()
        note = ("forward+backward ran but x.grad is None (upstream backward drops grad_input)"
                if x.grad is None else "forward+backward ran")
    except Exception as exc:
        note = f"backward failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    return (lambda: dconv(x)), note


def _time_full(args) -> float:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, args.channels, args.height, args.width, generator=g,
                    requires_grad=True)
    w = torch.randn(args.channels, args.channels, 3, 3, generator=g, requires_grad=True)
    b = torch.zeros(args.channels, requires_grad=True)
    return timeit(_fwd_bwd(lambda: F.conv2d(x, w, b, padding=1)), warmup=1, iters=args.iters)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--channels", type=int, default=64)
    ap.add_argument("--height", type=int, default=512)
    ap.add_argument("--width", type=int, default=512, help="full width (sharded over ranks)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--pin", action="store_true", help="bind rank r to core r")
    args = ap.parse_args()
    n = args.ranks

    rows = run_on_ranks(n, _rank_bench, args)
    full = _time_full(args)  # alone, after the ranks are done: no core contention

    table = []
    for r in range(n):
        row = rows[r]
        table.append([r, "x".join(map(str, row["local_shape"])), row["tp_conv"],
                      row["local_shard"], row["tp_conv"] / row["local_shard"],
                      row["tp_conv_cpu"], row["local_shard_cpu"],
                      row["tp_conv_cpu"] / row["local_shard_cpu"], full, full / n,
                      row["tp_conv_fwd"], row["local_shard_fwd"],
                      row.get("torch_dtensor_fwd", "n/a")])
    cols = ["rank", "local input", "tp_conv fwd+bwd s", "local shard fwd+bwd s", "ratio",
            "tp_conv CPU s", "local shard CPU s", "CPU ratio",
            "full 1-proc fwd+bwd s", "full/N s", "tp_conv fwd s", "local shard fwd s",
            "torch DTensor fwd s"]
    print_table(f"3x3 conv {args.channels}->{args.channels}, N={n} (gloo, 1 thread/rank)",
                cols, table)
    for r in range(n):
        print(f"torch DTensor _tp_conv, rank {r}: {rows[r]['torch_dtensor_note']}")
    worst = max(rows[r]["tp_conv"] / rows[r]["local_shard"] for r in range(n))
    worst_cpu = max(rows[r]["tp_conv_cpu"] / rows[r]["local_shard_cpu"] for r in range(n))
    print(f"worst rank tp_conv / local shard = {worst:.3f} wall, {worst_cpu:.3f} CPU "
          "(target <= 1.15)")
    write_json(NAME, {"args": vars(args), "ranks": rows, "full_single_process_s": full,
                      "worst_ratio": worst, "worst_cpu_ratio": worst_cpu})
    labels = [f"rank {r}" for r in range(n)]
    series = {
        "tp_conv": (labels, [rows[r]["tp_conv"] for r in range(n)]),
        "local shard (no exchange)": (labels, [rows[r]["local_shard"] for r in range(n)]),
        "full / N (ideal)": (labels, [full / n] * n),
    }
    series["tp_conv fwd only"] = (labels, [rows[r]["tp_conv_fwd"] for r in range(n)])
    series["local shard fwd only"] = (labels, [rows[r]["local_shard_fwd"] for r in range(n)])
    if all("torch_dtensor_fwd" in rows[r] for r in range(n)):
        series["torch DTensor fwd only"] = (labels,
                                            [rows[r]["torch_dtensor_fwd"] for r in range(n)])
    print(plot(NAME, f"3x3 conv fwd+bwd per rank, N={n}", "rank", "seconds", series, kind="bar"))
    print(machine())


if __name__ == "__main__":
    main()
