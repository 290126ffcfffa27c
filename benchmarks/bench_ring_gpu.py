"""Ring attention on one GPU shared by N ranks (torch's threaded process
group), forward + backward, against the ideal and against torch's own context
parallelism, measured in the same run:

- full SDPA: one full-sequence call on the fastest backend (flash, efficient
  and cuDNN are each timed alone; the best sets the ideal). The N ranks' work
  runs one after another on the one GPU, so t(ring) / t(full) is the ring's
  whole overhead and 1.00 is ideal;
- cplib.ring_sdpa per backend (flash, efficient, cuDNN, and auto) and per
  rotation (p2p, alltoall, allgather; efficient and auto with p2p only), and
  cplib's all-gather path as Llama 3 runs it (cplib/ring/allgather.py,
  "llama3/allgather": one call per query chunk, no merge);
- torch's _templated_ring_attention forward and backward with its flash and
  cuDNN ops (alltoall and allgather: torch has no send/recv rotation);
- a GQA row (Hq=16, Hkv=4), and the CUDA merge kernel's bandwidth against a
  device-to-device copy of the same bytes;
- where the time goes (issue 54): cuDNN's rings (cplib's and torch's) and
  cplib's default call run one more step under torch.profiler, split into
  attention kernels, other kernels (merges, casts, copies, adds), the
  threaded group's copies and device idle time (gpu/ring_profile.py), with
  each rank's own kernel time and the bytes it sent; T_blocks, the ring's
  planned attention calls each timed alone fwd+bwd in one thread
  (gpu/ring_blocks.py); and a projection of each rank onto a GPU of its own
  over an assumed link (gpu/ring_split_report.py: 400 GB/s, NVLink 4).

B=1, H=16, D=128, bf16; each time is the median of 5 steps after 2 warm-ups,
every rank's work included (barrier and device synchronisation around each
step). Every measurement is a cell run in a worker process with its own
time limit (--cell-timeout, 60 s): a cell that hangs (in CUDA, or a threaded
process group waiting forever) is killed with its worker and costs that cell
only (benchmarks/gpu/cells.py); cells not started within --budget are
reported as skipped. bench_ring_gpu.json is rewritten after every cell
(``complete`` false until the end), so a run cut short keeps what it
measured. At the end it prints the tables and the cells without a figure
(errors, NaN, time-outs, skips, splits that failed), writes bench_ring_gpu.png
(ratios against S, and the splits as stacked bars) under benchmarks/out/ (or
$CPLIB_BENCH_OUT), and on a GPU
benchmarks/results/gpu.json (--results): device, torch, commit, date and one
row per ring variant (S, N, causal, backend, rotate, full_ms, cplib_ms,
torch_ms, ratio_full, ratio_torch); the commit is $CPLIB_COMMIT (set by the
GPU check from the prepared wheel), else git's HEAD.

    python benchmarks/bench_ring_gpu.py                 # default rows (72-117 s on an H100)
    python benchmarks/bench_ring_gpu.py --all           # S 8k..64k x N 2,4 x causal or not
    python benchmarks/bench_ring_gpu.py --device cpu --smoke   # the code path, tiny, no GPU

Process-global state (SDPA backend flags, torch's _cp_options) is set in the
main thread only, never in the rank threads. The efficient backend's rings
run last: a sticky CUDA error there cannot spoil the other figures.

What only the threaded group measures: the N ranks share one device and
their collectives are Python (a thread barrier, then rank 0 copies every
rank's data, ``multi_threaded_pg.py``), so the device idles while the ranks'
host work and the group's Python run; the split shows how much, and the
projection leaves the group's copies out (on N GPUs they are the link's).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "support"))
sys.path.insert(0, os.path.join(HERE, "gpu"))
import common  # noqa: E402
import ring_report as report  # noqa: E402
import ring_split_report as split_report  # noqa: E402
from cells import SKIPPED, run_cells, worker_main  # noqa: E402
from common import machine, write_json  # noqa: E402
from ring_timing import (ROTATIONS, TORCH_ROTATIONS, Config, Setup, cplib_rank,  # noqa: E402
                         inputs, llama3_rank, merge_bandwidth, run_ring, time_full,
                         time_plan_blocks, time_torch_cp)

# ---------------------------------------------------------------- driver


def _configs(args) -> list[Config]:
    h = args.heads
    if args.smoke:
        seqs, worlds = [128, 256], [2]
        base = [Config(s, n, c, h, h) for s, n, c in itertools.product(seqs, worlds, (True, False))]
        return base + [Config(256, 2, True, h, max(h // 4, 1))]
    if args.seqs:
        seqs = [int(x) for x in args.seqs.split(",")]
        worlds = [int(x) for x in args.worlds.split(",")]
        return [Config(s, n, c, h, h)
                for s, n, c in itertools.product(seqs, worlds, (True, False))]
    if args.all:
        base = [Config(s, n, c, h, h) for s, n, c in
                itertools.product([8192, 16384, 32768, 65536], [2, 4], (True, False))]
        return base + [Config(32768, 4, True, h, h // 4)]
    # The rows that carry the speed goals (72-117 s on the H100 runs of
    # 2026-11-25); the most telling first, so that a --budget cut drops the least.
    return [Config(32768, 4, True, h, h), Config(65536, 4, True, h, h),
            Config(32768, 4, True, h, h // 4), Config(32768, 2, True, h, h),
            Config(8192, 4, True, h, h), Config(32768, 4, False, h, h)]




def _profiled(st: Setup, backend: str) -> bool:
    """Whether a ring variant runs one more step under the profiler
    (ring_profile.py): on CUDA cuDNN's (the fastest backend on every row of
    the H100 and H200 runs so far, and SDPA's choice there: cplib's and
    torch's rings), cplib's default call and its all-gather path; on the
    CPU every variant."""
    return st.device.type != "cuda" or backend in ("cudnn", "auto", "llama3")


def _cells(configs: list[Config], st: Setup, cuda: bool, merge_shapes) -> list[dict]:
    """Every measurement, in running order: the merge kernel, then per
    configuration full SDPA, T_blocks, torch's ring and cplib's rings; the
    efficient backend's rings last (a sticky CUDA error there cannot spoil
    the rest), p2p only (it was the slowest backend by 3x on every row of
    the H200 runs, whatever the rotation)."""
    cells = [dict(label=f"merge {'x'.join(map(str, sh))}", impl="merge", shape=list(sh))
             for sh in merge_shapes]
    late = [b for b in st.backends if b == "efficient"]
    early = [b for b in st.backends if b not in late] + ([None] if cuda else [])
    for phase, backends in (("main", early), ("efficient", late)):
        for ci, cfg in enumerate(configs):
            def cell(impl, key, backend=""):
                return dict(label=f"{cfg.label} {impl} {key}", impl=impl, key=key, config=ci,
                            profile=impl in ("cplib", "torch") and _profiled(st, backend))
            if phase == "main":
                cells += [cell("full", b) for b in (st.backends if cuda else ["cpu"])]
                cells.append(cell("blocks", ",".join(st.block_backends)))
                cells += [cell("torch", f"{op}/{rot}", op)
                          for op, rot in itertools.product(st.torch_ops, TORCH_ROTATIONS)]
            cells += [cell("cplib", f"{b or 'auto'}/{rot}", b or "auto")
                      for b, rot in itertools.product(backends, ROTATIONS)
                      if rot == "p2p" or (b is not None and phase == "main")]
            if phase == "main":  # the all-gather path, Llama 3's (SDPA's kernel choice)
                cells.append(cell("cplib", "llama3/allgather", "llama3"))
    return cells


class _Worker:
    """The worker process's state: the inputs of the configuration last used."""

    def __init__(self, configs: list[Config], st: Setup):
        self.configs, self.st, self.inputs, self.config = configs, st, None, None

    def full(self, ci: int) -> list[torch.Tensor]:
        if self.config != ci:
            self.inputs = None
            if self.st.device.type == "cuda":
                torch.cuda.empty_cache()
            self.inputs, self.config = inputs(self.configs[ci], self.st), ci
        return self.inputs

    def run(self, cell: dict) -> Any:
        if os.environ.get("CPLIB_BENCH_HANG_CELL") == cell["label"]:
            time.sleep(3600)  # tests/gpu/test_gpu_check.py: a cell that never ends
        if cell["impl"] == "merge":
            return merge_bandwidth(self.st, [tuple(cell["shape"])])[0]
        cfg = self.configs[cell["config"]]
        full = self.full(cell["config"])
        if cell["impl"] == "full":
            return time_full(cfg, self.st, cell["key"], full)
        if cell["impl"] == "blocks":
            return time_plan_blocks(cfg, self.st, cell["key"].split(","))
        if cell["impl"] == "torch":
            op, rot = cell["key"].split("/")
            return time_torch_cp(cfg, self.st, full, op, rot, profile=cell["profile"])
        b, rot = cell["key"].split("/")
        if b == "llama3":
            return run_ring(llama3_rank, cfg, self.st, full, profile=cell["profile"])
        return run_ring(cplib_rank, cfg, self.st, full, None if b == "auto" else b, rot,
                        profile=cell["profile"])


def _device_broken(dev: torch.device) -> bool:
    if dev.type != "cuda":
        return False
    try:
        torch.cuda.synchronize(dev)
        torch.zeros(1, device=dev).add_(1).item()
        return False
    except RuntimeError:
        return True


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--smoke", action="store_true", help="tiny shapes: check the code path")
    p.add_argument("--all", action="store_true", help="S 8192..65536 x N 2,4 x causal or not")
    p.add_argument("--seqs", help="comma-separated S values (with --worlds), instead of the rows")
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--no-torch", action="store_true", help="skip torch's own ring")
    p.add_argument("--budget", type=float, default=0,
                   help="seconds; cells not started by then are reported as skipped")
    p.add_argument("--cell-timeout", type=float, default=60,
                   help="seconds one cell may take (a hung cell costs that cell only)")
    p.add_argument("--out", help="output folder (default $CPLIB_BENCH_OUT or benchmarks/out)")
    p.add_argument("--results", default=report.RESULTS_DEFAULT,
                   help="where a CUDA run writes its results file (device, torch, commit, date, "
                        f"one row per ring variant; default {report.RESULTS_DEFAULT}); '' for none")
    p.add_argument("--worker", nargs=2, metavar=("SPEC", "PROGRESS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.out:
        common.OUT_DIR = args.out
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_ring_gpu: no CUDA GPU visible; nothing measured "
              "(use --device cpu --smoke to check the code path)", flush=True)
        return 0 if os.environ.get("CPLIB_BENCH_REQUIRE_GPU", "0") != "1" else 1
    t_start = time.time()
    dev = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    cuda = dev.type == "cuda"
    if args.smoke:
        args.heads, args.head_dim = 4, 16
    st = Setup(device=dev, dtype=torch.bfloat16 if cuda else torch.float32, b=1,
               d=args.head_dim, warmup=args.warmup, iters=args.iters,
               backends=["flash", "efficient", "cudnn"] if cuda else ["flash"],
               block_backends=["flash", "cudnn"] if cuda else ["cpu"],
               torch_ops=[] if args.no_torch else (["flash", "cudnn"] if cuda else ["cpu"]))
    configs = _configs(args)
    merge_shapes = ([(1, 16, 8192, 128), (1, 32, 32768, 128)] if cuda and not args.smoke
                    else [(1, 4, 256, 16)])
    cells = _cells(configs, st, cuda, merge_shapes)
    if args.worker:
        if cuda:
            torch.cuda.set_device(dev)
        worker = _Worker(configs, st)
        return worker_main(*args.worker, worker.run, lambda: _device_broken(dev))

    print(f"bench_ring_gpu: {machine()}; commit {report.commit()}; B={st.b} H={args.heads} "
          f"D={st.d} {str(st.dtype).split('.')[-1]}, fwd+bwd, median of {st.iters} after "
          f"{st.warmup} warm-ups; {len(configs)} configurations, {len(cells)} cells, each at "
          f"most {args.cell_timeout:.0f} s in a worker process", flush=True)
    results: dict[Config, dict[str, Any]] = {}
    merge: list[Any] = [SKIPPED] * len(merge_shapes)
    meta = dict(B=st.b, H=args.heads, D=st.d, dtype=str(st.dtype), warmup=st.warmup,
                iters=st.iters, commit=report.commit(), cells=len(cells))

    def payload(done: int) -> dict:
        return dict(meta, rows=report.payload_rows(configs, results), merge=merge,
                    cells_done=done, seconds=time.time() - t_start)
    done = [0]

    def on_result(i: int, value: Any) -> None:
        c = cells[i]
        done[0] += 1
        if c["impl"] == "merge":
            merge[merge_shapes.index(tuple(c["shape"]))] = value
        else:
            r = results.setdefault(configs[c["config"]], {"full": {}, "cplib": {}, "torch": {},
                                                          "profile": {}, "blocks": {}})
            if c["impl"] == "blocks":
                r["blocks"] = value if isinstance(value, dict) else {c["key"]: value}
            elif isinstance(value, dict):  # a profiled ring: its time and its split
                r[c["impl"]][c["key"]] = value["seconds"]
                r["profile"][f"{c['impl']}/{c['key']}"] = value["profile"]
            else:
                r[c["impl"]][c["key"]] = value
                if c.get("profile"):
                    r["profile"][f"{c['impl']}/{c['key']}"] = {"error": f"no step: {value}"}
        shown = split_report.shown(c, value)
        print(f"  [{time.time() - t_start:4.0f} s] cell {done[0]}/{len(cells)} {c['label']}: "
              f"{shown}", flush=True)
        write_json("bench_ring_gpu", dict(payload(done[0]), complete=False))

    deadline = t_start + args.budget if args.budget else float("inf")
    run_cells(cells, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]],
              cell_timeout=args.cell_timeout, deadline=deadline, on_result=on_result,
              log=lambda m: print(f"  [{time.time() - t_start:4.0f} s] {m}", flush=True))

    final = payload(done[0])
    rows = final["rows"]
    goal_rows = report.goals(rows, merge)
    problems = report.problem_cells(final)
    report.print_tables(rows, merge, goal_rows, st, args.heads, dev.type)
    path = write_json("bench_ring_gpu", dict(
        final, complete=True, goals=[dict(goal=g, measured=m, met=ok) for g, m, ok in goal_rows],
        problems=problems))
    if cuda and args.results:
        print(f"results: {report.write_results(args.results, rows, dev)}", flush=True)
    png = split_report.plot_png(os.path.join(common.OUT_DIR, "bench_ring_gpu.png"),
                                report.plot_series(rows), rows,
                                "ring attention fwd+bwd: cplib (best) / baseline")
    for kind, items in problems.items():
        print(f"cells without a figure ({kind}): {len(items)}", flush=True)
        for item in items[:40]:
            print(f"  {item}", flush=True)
    print(f"{machine()}\njson: {path}\npng: {png}\n"
          f"bench_ring_gpu: {time.time() - t_start:.0f} s", flush=True)
    if not any(isinstance(v, (int, float)) for r in rows for v in r["cplib_ms"].values()):
        print("bench_ring_gpu: no cplib ring ran (every cell is an error)", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
