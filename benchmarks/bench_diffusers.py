"""cplib against diffusers' own context parallelism on the Flux model (CPU,
gloo, one thread per rank), forward of the whole model, measured in one run:

* diffusers' Ulysses (``ContextParallelConfig(ulysses_degree=N)``; its
  ``enable_parallelism`` divides by the accelerator count, 0 on a CPU-only
  machine, so the benchmark sets the config up itself, as enable_parallelism
  would, on a CPU mesh);
* cplib's Ulysses (``context_parallel(..., ulysses_degree=N)``) and ring
  (``ulysses_degree=1``), the same model, its inputs sharded as buffers.

Both libraries shard the same way (the text and the image tokens cut in N
sequential pieces each), and the outputs are checked against each other.
Figures are the median CPU seconds per rank per forward (the work a rank
does, robust on a shared machine) and the wall time, round-robin.

    python benchmarks/bench_diffusers.py      # 4096 image + 512 text tokens, N=2
    CPLIB_BENCH_IMAGE=1024 CPLIB_BENCH_TEXT=128 python benchmarks/bench_diffusers.py
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from common import (cpu_seconds, interleaved, machine, plot, print_table,  # noqa: E402
                    run_on_ranks, write_json)

IMAGE = int(os.environ.get("CPLIB_BENCH_IMAGE", "4096"))
TEXT = int(os.environ.get("CPLIB_BENCH_TEXT", "512"))
ITERS = int(os.environ.get("CPLIB_BENCH_ITERS", "5"))
WORLDS = [int(x) for x in os.environ.get("CPLIB_BENCH_WORLDS", "2").split(",")]
HEADS, HEAD_DIM = 8, 64


def _flux():
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
        attention_head_dim=HEAD_DIM, num_attention_heads=HEADS, joint_attention_dim=64,
        pooled_projection_dim=32, axes_dims_rope=(16, 24, 24)).eval()


def _inputs() -> dict[str, torch.Tensor]:
    side = int(IMAGE ** 0.5)
    g = torch.Generator().manual_seed(1)
    img_ids = torch.zeros(side * side, 3)
    img_ids[:, 1] = torch.arange(side).repeat_interleave(side)
    img_ids[:, 2] = torch.arange(side).repeat(side)
    return dict(hidden_states=torch.randn(1, side * side, 16, generator=g),
                encoder_hidden_states=torch.randn(1, TEXT, 64, generator=g),
                pooled_projections=torch.randn(1, 32, generator=g),
                timestep=torch.tensor([0.5]), img_ids=img_ids, txt_ids=torch.zeros(TEXT, 3))


def _diffusers_ulysses(model, n: int):
    """diffusers' Ulysses on a CPU mesh: what enable_parallelism does after
    choosing the device (which fails without an accelerator)."""
    from diffusers.hooks.context_parallel import apply_context_parallel
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    cp = ContextParallelConfig(ulysses_degree=n)
    mesh = init_device_mesh("cpu", (1, n), mesh_dim_names=("ring", "ulysses"))
    cp.setup(dist.get_rank(), n, torch.device("cpu"), mesh)
    config = ParallelConfig(context_parallel_config=cp)
    for module in model.modules():
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(processor, "_parallel_config"):
            processor._parallel_config = config
    model._parallel_config = config
    apply_context_parallel(model, cp, model._cp_plan)
    return model


def _bench(n: int) -> dict:
    import cplib
    from torch.distributed.device_mesh import DeviceMesh

    inputs = _inputs()
    names = ["hidden_states", "encoder_hidden_states", "img_ids", "txt_ids"]
    mesh = DeviceMesh("cpu", list(range(n)))
    theirs = _diffusers_ulysses(_flux(), n)
    ours = _flux()

    def diffusers_ulysses():
        with torch.no_grad():
            return theirs(**inputs, return_dict=False)[0]  # its plan gathers the output

    def cplib_run(u: int):
        def run():
            kw = {k: v.clone() for k, v in inputs.items()}
            with torch.no_grad(), cplib.context_parallel(
                    mesh, buffers=[kw[k] for k in names], buffer_seq_dims=[1, 1, 0, 0],
                    ulysses_degree=u) as cp:
                out = ours(**kw).sample
                return cp.unshard([out], [1])[0]
        return run

    fns = {"diffusers ulysses": diffusers_ulysses, "cplib ulysses": cplib_run(n),
           "cplib ring": cplib_run(1)}
    ref = fns["diffusers ulysses"]()
    for name, fn in fns.items():
        err = (fn() - ref).abs().max().item()
        assert err < 1e-4, f"{name} differs from diffusers' Ulysses by {err}"
    wall = interleaved(fns, ITERS, sync=dist.barrier)
    cpu = {}
    for _ in range(2):  # round-robin, twice, for the same reason
        for name, fn in fns.items():
            cpu.setdefault(name, []).append(cpu_seconds(fn, max(1, ITERS // 2)))
    return {"wall": wall, "cpu": {k: min(v) for k, v in cpu.items()}}


def main() -> None:
    rows, results = [], {}
    for n in WORLDS:
        per_rank = run_on_ranks(n, _bench, n)
        # The slowest rank is the step time.
        wall = {k: max(r["wall"][k] for r in per_rank) for k in per_rank[0]["wall"]}
        cpu = {k: max(r["cpu"][k] for r in per_rank) for k in per_rank[0]["cpu"]}
        base = cpu["diffusers ulysses"]
        for k in wall:
            rows.append([n, k, wall[k] * 1e3, cpu[k] * 1e3, cpu[k] / base])
        results[n] = {"wall_s": wall, "cpu_s": cpu}
    title = (f"Flux forward, {IMAGE} image + {TEXT} text tokens, {HEADS} heads x {HEAD_DIM}, "
             f"1 + 1 blocks, fp32, CPU gloo ({machine()})")
    print_table(title, ["N", "variant", "wall ms", "CPU ms / rank", "CPU vs diffusers"], rows)
    write_json("bench_diffusers", {"image": IMAGE, "text": TEXT, "results": results})
    plot("bench_diffusers", "Flux forward per rank (CPU s)", "variant", "CPU s",
         {f"N={n}": (list(results[n]["cpu_s"]), list(results[n]["cpu_s"].values()))
          for n in WORLDS}, kind="bar")


if __name__ == "__main__":
    main()
