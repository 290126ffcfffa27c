"""Flex-attention context parallelism: the flex ring against the all-gather,
side by side in one run (issue 35). Per rank, on gloo ranks with one thread
each: the time of one forward+backward (slowest rank, median of interleaved
rounds), the peak memory beyond the inputs (CPU allocator, torch.profiler),
the K/V bytes one forward receives and its flex_attention calls, for

  causal (head-tail), 28 packed documents (causal inside each, random
  lengths as torch's tests; head-tail), sliding window 512 (no balancer),
  prefix-LM with a prefix of S/4 (head-tail),

B=1, H=8, D=64, fp32, block 128. Each path runs compiled two ways: the
whole CP model under torch.compile(backend="aot_eager", fullgraph=True),
and ("module") an eager model whose attention module holds
torch.compile(flex_attention) (as torchtitan's), which the ring's steps
are compiled into. Both use flex's own dense implementation, with torch's
"no flex backward on CPU" guard lifted (as the tests do); inductor's CPU
flex kernel is forward-only and returns no lse, which the ring needs. Dense
flex materialises each call's (queries x keys) scores, so memory grows with
them: a variant whose estimate exceeds --mem-gib (all ranks together) is
skipped and says so. "torch" is torch's
own flex CP (its all-gather) on causal; "ideal" the whole sequence in one
process (one thread) divided by N, where it fits.

  python benchmarks/bench_flex_cp.py --ranks 4 --seqs 4096 8192 --iters 5
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from common import (interleaved, machine, peak_bytes, print_table,  # noqa: E402
                    run_on_ranks, write_json)

NAME = "bench_flex_cp"
PATHS = ("allgather", "ring", "allgather module", "ring module")
MASKS = ("causal", "documents", "window", "prefix")
BALANCED = {"causal": True, "documents": True, "window": False, "prefix": True}
# Peak bytes of one dense flex fwd+bwd per (query x key) score of one head,
# measured (fp32, H=8: 3.7 GiB for 2048 x 8192), with some room.
DENSE_BYTES_PER_SCORE = 32


def _mask_mod(kind: str, S: int):
    if kind == "causal":
        return lambda b, h, q, kv: q >= kv
    if kind == "window":
        return lambda b, h, q, kv: (q >= kv) & (q - kv <= 512)
    if kind == "prefix":
        return lambda b, h, q, kv: (q >= kv) | (kv < S // 4)
    g = torch.Generator().manual_seed(28)
    cuts = torch.randperm(S - 1, generator=g)[:27].add(1).sort().values
    doc = torch.zeros(S, dtype=torch.long).index_fill_(0, cuts, 1).cumsum(0)
    return lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv)


class _Attention(torch.nn.Module):
    def forward(self, query, key, value, block_mask=None):
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(query, key, value, block_mask=block_mask)


class _HoldsCompiledFlex(torch.nn.Module):
    """An attention module holding a compiled flex_attention (torchtitan's way)."""

    flex = None  # one per process

    def forward(self, query, key, value, block_mask=None):
        return _HoldsCompiledFlex.flex(query, key, value, block_mask=block_mask)


class _Model(torch.nn.Module):
    """Wraps the attention module so one compiled frame holds the CP hook too."""

    def __init__(self, attn: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.attn = _Attention() if attn is None else attn

    def forward(self, *args, **kwargs):
        return self.attn(*args, **kwargs)


def _fwd_bwd(model, q, k, v, mask, cot, method):
    """One forward+backward of ``model`` under ``set_rotate_method(method)``."""
    import cplib
    from cplib.frontend.options import _cp_options

    def step():
        before = _cp_options.rotate_method
        if method:
            cplib.set_rotate_method(method)
        try:
            model(q, k, v, block_mask=mask).backward(cot)
        finally:
            _cp_options.rotate_method = before
        q.grad = k.grad = v.grad = None
    return step


def _variants(lib, mesh, args, S: int, kind: str):
    """{name: (step, estimated bytes per rank)} of one (S, mask) and the
    plan's ring statistics."""
    from torch.distributed.tensor.parallel import parallelize_module

    import cplib
    from cplib.flex.block_mask import _compiled_create_block_mask
    from cplib.flex.plan import SHARD_ATTR

    n, H = mesh.size(), args.heads
    g = torch.Generator().manual_seed(S)
    full = [torch.randn(1, H, S, args.dim, generator=g) for _ in range(4)]
    mask = _compiled_create_block_mask()(_mask_mod(kind, S), 1, 1, S, S, device="cpu",
                                         BLOCK_SIZE=args.block)
    out, stats = {}, {}
    libs = {"cplib": cplib} if kind != "causal" or lib is None else {"cplib": cplib, "torch": lib}
    for name, mod in libs.items():
        lb = mod._HeadTailLoadBalancer(S, n, "cpu") if BALANCED[kind] else None
        try:
            with torch.compiler.set_stance("force_eager"):
                q, k, v, cot, local = mod._context_parallel_shard(mesh, [*full, mask],
                                                                  [2] * 4 + [0], lb)
        except Exception as exc:  # torch's prototype may not run here
            stats["torch_note"] = f"{type(exc).__name__}: {exc}"[:200]
            continue
        for t in (q, k, v):
            t.requires_grad_(True)
        model = parallelize_module(_Model(), mesh, {"attn": mod._ContextParallel(
            seq_dim=2, attention_type=mod._ContextParallel.AttentionType.FLEX)})
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        dense = DENSE_BYTES_PER_SCORE * H * (S // n) * S
        if name == "torch":
            out["torch allgather"] = (_fwd_bwd(compiled, q, k, v, local, cot, None), dense)
            continue
        shard, FLEX = getattr(local, SHARD_ATTR), cplib._ContextParallel.AttentionType.FLEX
        ring_dense = DENSE_BYTES_PER_SCORE * H * (S // n) * max(
            (s.recv_rows or S // n) for s in shard.steps)
        module = parallelize_module(_Model(_HoldsCompiledFlex()), mesh, {
            "attn": cplib._ContextParallel(seq_dim=2, attention_type=FLEX)})
        for path, method, est in (("allgather", "allgather", dense), ("ring", "p2p", ring_dense)):
            out[path] = (_fwd_bwd(compiled, q, k, v, local, cot, method), est)
            out[f"{path} module"] = (_fwd_bwd(module, q, k, v, local, cot, method), est)
        stats = {"ring_calls": shard.calls, "ring_recv_rows": shard.recv_rows,
                 "allgather_recv_rows": (n - 1) * (S // n),
                 "row_bytes": 2 * H * args.dim * 4, "block_rows": S // n}
    if DENSE_BYTES_PER_SCORE * H * S * S <= args.mem_gib * 2 ** 30 / 2:
        attn = torch.compile(_Attention(), backend="aot_eager", fullgraph=True)
        fq, fk, fv = (t.clone().requires_grad_(True) for t in full[:3])
        run = _fwd_bwd(attn, fq, fk, fv, mask, full[3], None)
        # One process on the machine: the other ranks wait at the barrier.
        out["ideal"] = ((run if dist.get_rank() == 0 else (lambda: None)), 0)
    return out, stats


def _bytes_received(step) -> int:
    from cplib.flex.ring_ops import ring_bytes_received

    ring_bytes_received(reset=True)
    step()
    return ring_bytes_received(reset=True)


def _rank_bench(args) -> list[dict]:
    """Every (S, mask) on this rank: times, peaks and the ring's plan."""
    import unittest.mock

    import torch.nn.attention.flex_attention as fa
    from torch.distributed.device_mesh import DeviceMesh

    _HoldsCompiledFlex.flex = torch.compile(fa.flex_attention, backend="aot_eager",
                                            fullgraph=True)
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 1024
    torch_lib = None
    try:
        import torch.distributed.tensor.experimental._context_parallel._attention as tcp
        from torch.distributed.tensor.experimental._context_parallel import _load_balancer
        torch_lib = argparse.Namespace(
            _HeadTailLoadBalancer=_load_balancer._HeadTailLoadBalancer,
            _context_parallel_shard=tcp._context_parallel_shard,
            _ContextParallel=tcp._ContextParallel)
    except ImportError:
        pass
    n = dist.get_world_size()
    mesh = DeviceMesh("cpu", list(range(n)))
    budget = args.mem_gib * 2 ** 30 / n
    rows = []
    with unittest.mock.patch.object(fa, "_validate_device", lambda *a: None):
        for S in args.seqs:
            for kind in args.masks:
                variants, stats = _variants(torch_lib, mesh, args, S, kind)
                row = {"S": S, "mask": kind, **stats, "skipped": {}}
                fns = {}
                for name, (step, est) in variants.items():
                    if est > budget:
                        row["skipped"][name] = f"needs ~{est / 2 ** 30:.1f} GiB per rank"
                    else:
                        fns[name] = step
                if "ring" in fns:  # forward and backward (blocks again, dK|dV back)
                    row["ring_fwd_bwd_bytes"] = _bytes_received(fns["ring"])
                row.update({f"{k}_s": t for k, t in interleaved(fns, args.iters, dist.barrier)
                            .items()})
                for name in PATHS:
                    if name in fns:
                        dist.barrier()
                        row[f"{name}_peak"] = peak_bytes(fns[name])
                rows.append(row)
                del variants, fns
                if dist.get_rank() == 0:  # progress: this rank's view of the row
                    print(f"[rank 0] S={S} {kind}: " + ", ".join(
                        f"{k} {v:.3g}" for k, v in row.items() if k.endswith(("_s", "_peak"))),
                        flush=True)
    return rows


def _table(args, per_rank) -> tuple[list[str], list[list], list[dict]]:
    n = args.ranks
    columns = ["S", "mask", "all-gather (s)", "ring (s)", "ring / all-gather",
               "module: all-gather (s)", "module: ring (s)", "module: ring / all-gather",
               "torch (s)", "ideal full/N (s)", "peak all-gather (MiB)", "peak ring (MiB)",
               "peak ratio", "module: peak ratio", "K/V recv ring (blocks)",
               "K/V recv all-gather (blocks)", "ring calls"]
    table, records = [], []
    for i, r0 in enumerate(per_rank[0]):
        worst = {k: max(per_rank[r][i][k] for r in range(n)) for k in r0
                 if k.endswith("_s") or k.endswith("_peak") or k.endswith("_bytes")
                 or k in ("ring_calls", "ring_recv_rows")}
        worst["ring_fwd_bytes"] = worst["ring_recv_rows"] * r0["row_bytes"]  # the plan's
        rec = {**{k: r0[k] for k in ("S", "mask", "skipped", "row_bytes", "block_rows",
                                     "allgather_recv_rows", "torch_note") if k in r0}, **worst,
               "per_rank": [per_rank[r][i] for r in range(n)]}
        block_bytes = rec["row_bytes"] * rec["block_rows"]
        get = lambda k, scale=1.0: rec[k] * scale if k in rec else "skipped"
        ratio = lambda a, b: rec[a] / rec[b] if a in rec and b in rec else "n/a"
        ideal = rec["ideal_s"] / n if "ideal_s" in rec else "n/a"
        table.append([rec["S"], rec["mask"], get("allgather_s"), get("ring_s"),
                      ratio("ring_s", "allgather_s"), get("allgather module_s"),
                      get("ring module_s"), ratio("ring module_s", "allgather module_s"),
                      get("torch allgather_s"), ideal,
                      get("allgather_peak", 2 ** -20), get("ring_peak", 2 ** -20),
                      ratio("ring_peak", "allgather_peak"),
                      ratio("ring module_peak", "allgather module_peak"),
                      get("ring_fwd_bytes", 1 / block_bytes),
                      rec["allgather_recv_rows"] / rec["block_rows"], get("ring_calls")])
        records.append(rec)
    return columns, table, records


def _plot(args, records) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from common import OUT_DIR

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    for color, kind in zip(("C0", "C1", "C2", "C3"), args.masks):
        rs = [r for r in records if r["mask"] == kind]
        for name, style, marker in (("allgather", "--", "s"), ("ring", "-", "o")):
            pts = [(r["S"], r[f"{name}_s"], r.get(f"{name}_peak")) for r in rs if f"{name}_s" in r]
            for ax, ys in ((ax_t, [p[1] for p in pts]), (ax_m, [p[2] / 2 ** 20 for p in pts])):
                if pts:
                    ax.plot([p[0] for p in pts], ys, style, marker=marker, color=color,
                            label=f"{kind} {name}")
    for ax, label in ((ax_t, "s per fwd+bwd (slowest rank)"), (ax_m, "peak MiB beyond inputs")):
        ax.set_xlabel("sequence length S")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    ax_m.legend(fontsize=7)
    fig.suptitle(f"flex CP, ring vs all-gather, N={args.ranks}, B=1 H={args.heads} "
                 f"D={args.dim} fp32 (CPU, gloo)")
    fig.tight_layout()
    os.makedirs(OUT_DIR, exist_ok=True)
    path = os.path.join(OUT_DIR, f"{NAME}_n{args.ranks}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--masks", nargs="+", default=list(MASKS), choices=MASKS)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--mem-gib", type=float, default=16.0,
                   help="memory all ranks together may use; larger variants are skipped")
    args = p.parse_args()

    per_rank = run_on_ranks(args.ranks, _rank_bench, args, timeout_s=7200)
    columns, table, records = _table(args, per_rank)
    title = (f"flex CP fwd+bwd, ring vs all-gather, N={args.ranks} (gloo, 1 thread/rank), "
             f"B=1 H={args.heads} D={args.dim} fp32, block {args.block}")
    print_table(title, columns, table)
    for r in records:
        for name, why in r["skipped"].items():
            print(f"S={r['S']} {r['mask']}: {name} skipped ({why})")
        if r.get("torch_note"):
            print(f"S={r['S']} {r['mask']}: torch's flex CP did not run: {r['torch_note']}")
    write_json(f"{NAME}_n{args.ranks}", {"args": vars(args), "rows": records})
    print(f"machine: {machine()}\nwrote {_plot(args, records)}")


if __name__ == "__main__":
    main()
