"""Flex-attention context parallelism: per-rank forward time of a causal
flex_attention at world size 2 (gloo, one thread per rank), K/V all-gathered
by cplib, against
  - flex_attention on the full sequence in one process (one thread; the ideal
    CP time is that divided by the world size). It runs on rank 0 while the
    other ranks wait, interleaved with the CP variants, so that it sees the
    same background load;
  - torch's own flex CP (its ``_context_parallel_shard`` + ``_ContextParallel``
    FLEX hook + ``flex_cp_allgather``) in the same run;
  - the parts of cplib's step: the local attention alone (K/V gathered
    beforehand) and the all-gather alone.

Everything runs ``torch.compile(fullgraph=True)`` with inductor, whose CPU flex
kernel is forward-only (torch has no CPU flex backward), so this times the
forward. Each variant is timed round-robin with the others (ranks aligned by a
barrier), so load changes on a shared machine hit every variant alike.

  python benchmarks/bench_flex_cp.py [--seqs 2048 4096 8192] [--heads 4] [--dim 64]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from common import interleaved, machine, plot, print_table, run_on_ranks, write_json  # noqa: E402

NAME = "bench_flex_cp"


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


class _Attention(nn.Module):
    def forward(self, query, key, value, block_mask=None):
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(query, key, value, block_mask=block_mask)


class _Model(nn.Module):
    """Wraps the attention module so one compiled frame holds the CP hook too."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = _Attention()

    def forward(self, *args, **kwargs):
        return self.attn(*args, **kwargs)


def _inputs(args, S: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(S)
    return [torch.randn(args.batch, args.heads, S, args.dim, generator=g) for _ in range(3)]


def _cp_variant(lib, mesh, args, S: int, balanced: bool):
    """A timed forward of ``lib``'s flex CP (cplib or torch's module)."""
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.nn.attention.flex_attention import create_block_mask

    n = mesh.size()
    mask = create_block_mask(causal, 1, 1, S, S, device="cpu")
    lb = lib._HeadTailLoadBalancer(S, n, "cpu") if balanced else None
    q, k, v, local_mask = lib._context_parallel_shard(mesh, [*_inputs(args, S), mask],
                                                      [2, 2, 2, 0], lb)
    model = parallelize_module(_Model(), mesh, {"attn": lib._ContextParallel(
        seq_dim=2, attention_type=lib._ContextParallel.AttentionType.FLEX)})
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    compiled(q, k, v, block_mask=local_mask)  # compile outside the timing
    return lambda: compiled(q, k, v, block_mask=local_mask)


def _parts(cplib, mesh, args, S: int) -> dict:
    """The full-sequence baseline and the two parts of a head-tail CP step."""
    from torch.nn.attention.flex_attention import create_block_mask

    n = mesh.size()
    mask = create_block_mask(causal, 1, 1, S, S, device="cpu")
    full_inputs = _inputs(args, S)
    lb = cplib._HeadTailLoadBalancer(S, n, "cpu")
    q, k, v, local_mask = cplib._context_parallel_shard(mesh, [*full_inputs, mask],
                                                        [2, 2, 2, 0], lb)
    group = dist.group.WORLD.group_name
    k_all, v_all = cplib.flex_cp_allgather(k, v, 2, group)
    attn = torch.compile(_Attention(), fullgraph=True, dynamic=False)
    attn(*full_inputs, block_mask=mask)
    attn(q, k_all, v_all, block_mask=local_mask)
    # The baseline runs on rank 0 alone (the others wait at the barrier), so it
    # is one process on the machine, as a single-device run would be.
    full = (lambda: attn(*full_inputs, block_mask=mask)) if mesh.get_local_rank() == 0 else (
        lambda: None)
    return {"full_sequence": full,
            "cplib_local_attention_only": lambda: attn(q, k_all, v_all, block_mask=local_mask),
            "cplib_allgather_only": lambda: cplib.flex_cp_allgather(k, v, 2, group)}


def _rank_bench(args) -> list[dict]:
    import cplib
    import torch.distributed.tensor.experimental._context_parallel._attention as torch_cp
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.experimental._context_parallel import _load_balancer

    torch._dynamo.config.recompile_limit = 64
    n = dist.get_world_size()
    mesh = DeviceMesh("cpu", list(range(n)))
    torch_lib = argparse.Namespace(
        _HeadTailLoadBalancer=_load_balancer._HeadTailLoadBalancer,
        _context_parallel_shard=torch_cp._context_parallel_shard,
        _ContextParallel=torch_cp._ContextParallel)
    rows = []
    for S in args.seqs:
        fns = {"cplib": _cp_variant(cplib, mesh, args, S, False),
               "cplib_head_tail": _cp_variant(cplib, mesh, args, S, True)}
        note = ""
        try:
            fns["torch_head_tail"] = _cp_variant(torch_lib, mesh, args, S, True)
        except Exception as exc:  # torch's prototype may not run on CPU/gloo
            note = f"torch flex CP failed: {type(exc).__name__}: {exc}"[:300]
        fns.update(_parts(cplib, mesh, args, S))
        row = {"S": S, "torch_note": note}
        row.update(interleaved(fns, args.iters, dist.barrier))
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args()

    per_rank = dict(enumerate(run_on_ranks(args.ranks, _rank_bench, args, timeout_s=900)))

    n = args.ranks
    columns = ["S", "full 1 proc (ms)", "ideal full/N (ms)", "cplib CP (ms)",
               "cplib CP head-tail (ms)", "torch CP head-tail (ms)", "local attn only (ms)",
               "all-gather only (ms)", "cplib head-tail / ideal"]
    table, records = [], []
    for i, S in enumerate(args.seqs):
        # A rank's step ends when the slowest rank's does: take the max over ranks.
        worst = {k: max(per_rank[r][i][k] for r in range(n))
                 for k in per_rank[0][i] if k not in ("S", "torch_note")}
        full = worst["full_sequence"]
        ideal = full / n
        torch_t = worst.get("torch_head_tail")
        table.append([S, full * 1e3, ideal * 1e3, worst["cplib"] * 1e3,
                      worst["cplib_head_tail"] * 1e3,
                      torch_t * 1e3 if torch_t is not None else "n/a",
                      worst["cplib_local_attention_only"] * 1e3,
                      worst["cplib_allgather_only"] * 1e3, worst["cplib_head_tail"] / ideal])
        per_rank_s = {k: [per_rank[r][i][k] for r in range(n)] for k in worst}
        records.append({"S": S, "ideal_s": ideal, **worst, "per_rank_s": per_rank_s,
                        "torch_note": per_rank[0][i]["torch_note"]})
    title = (f"flex CP forward, causal, world size {n} (gloo, 1 thread/rank), "
             f"B={args.batch} H={args.heads} D={args.dim}, fp32")
    print_table(title, columns, table)
    for r in records:
        if r["torch_note"]:
            print(f"S={r['S']}: {r['torch_note']}")
    write_json(NAME, {"args": vars(args), "world_size": n, "rows": records})
    series = {"full sequence, 1 process": (args.seqs, [r["full_sequence"] * 1e3 for r in records]),
              "ideal (full / N)": (args.seqs, [r["ideal_s"] * 1e3 for r in records]),
              "cplib CP": (args.seqs, [r["cplib"] * 1e3 for r in records]),
              "cplib CP head-tail": (args.seqs, [r["cplib_head_tail"] * 1e3 for r in records])}
    if all("torch_head_tail" in r for r in records):
        series["torch CP head-tail"] = (args.seqs, [r["torch_head_tail"] * 1e3 for r in records])
    path = plot(NAME, title, "sequence length", "ms per forward", series)
    print(f"machine: {machine()}\nwrote {path}")


if __name__ == "__main__":
    main()
