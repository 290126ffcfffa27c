"""One hybrid training step under context parallelism against one process,
and the two ways a Gated DeltaNet layer exchanges (cplib/hybrid/): head
re-sharding ("heads", all-to-alls of the projected streams, O(S) bytes) and
state passing ("state", one all-gather of each piece's final state and
transition, bytes independent of S; the kernel works on d_k more value
columns). A Qwen3-Next-shaped model (3 Gated DeltaNet layers and 1 attention
layer, transformers' torch kernels on CPU) runs fwd+bwd with ``labels=``,
N gloo ranks, one thread each, at two sequence lengths.

Per row: the one-process step (the ideal), each way's step under CP (wall
time of the slowest rank, and the CPU seconds of the busiest rank: on a
shared machine the CPU figure is the work, free of waiting for a core), the
bytes a rank receives per step (forward and backward, every collective of
the hybrid layers: the halo, the all-to-alls or the all-gather; the
attention layer's ring is the same for both and not counted), and the way
``"auto"`` picks with the seconds its model predicts each way adds per layer.

    python benchmarks/bench_hybrid.py
    CPLIB_BENCH_SEQS=512,4096 CPLIB_BENCH_ITERS=7 python benchmarks/bench_hybrid.py
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(__file__))
from common import (interleaved_wall_cpu, machine, plot, print_table, run_on_ranks,  # noqa: E402
                    write_json)

N = int(os.environ.get("CPLIB_BENCH_N", "2"))
SEQS = [int(x) for x in os.environ.get("CPLIB_BENCH_SEQS", "256,1024").split(",")]
ITERS = int(os.environ.get("CPLIB_BENCH_ITERS", "5"))
WAYS = ("heads", "state")


def _model():
    import transformers as tf

    import cplib.hf  # noqa: F401  (attn_implementation="cplib", the hybrid layers)

    cfg = tf.Qwen3NextConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=4, linear_num_value_heads=8,
        linear_key_head_dim=32, linear_value_head_dim=32, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=64, shared_expert_intermediate_size=64,
        attn_implementation="cplib", use_cache=False)
    torch.manual_seed(0)
    return tf.Qwen3NextForCausalLM(cfg).train()


class _Received(TorchDispatchMode):
    """Bytes this rank receives in the hybrid layers' collectives."""

    def __init__(self, n: int):
        super().__init__()
        self.n, self.bytes = n, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "_schema", None) and func._schema.name
        nbytes = [t.numel() * t.element_size() for t in args if isinstance(t, torch.Tensor)]
        if name in ("cplib_c::flex_cp_allgather", "cplib_c::flex_cp_allgather_backward_covered"):
            self.bytes += sum(nbytes) * (self.n - 1) // (1 if "backward" not in name else self.n)
        elif name in ("cplib_c::ulysses_reshard", "cplib_c::ulysses_reshard_covered"):
            self.bytes += nbytes[0] * (self.n - 1) // self.n
        elif name in ("cplib_c::seq_halo", "cplib_c::seq_halo_backward_covered"):
            self.bytes += abs(out.numel() - args[0].numel()) * out.element_size()
        return out


def _step(model, ids, labels, way=None, counter=None):
    import contextlib

    import cplib
    from torch.distributed.device_mesh import DeviceMesh

    model.zero_grad(set_to_none=True)
    if way is None:  # one process, the whole sequence
        model(input_ids=ids, labels=labels).loss.backward()
        return
    bufs = [ids.clone(), labels.clone()]
    with cplib.context_parallel(DeviceMesh("cpu", list(range(dist.get_world_size()))),
                                buffers=bufs, buffer_seq_dims=[1, 1],
                                no_restore_buffers=set(bufs), load_balance=True), \
            cplib.recurrence_exchange(way), counter or contextlib.nullcontext():
        model(input_ids=bufs[0], labels=bufs[1]).loss.backward()


def _measure(s: int) -> dict:
    from cplib.hybrid.choice import WIDENED_UNIT_S, DeltaShape, choose_exchange, exchange_costs
    from cplib.attention.names import Layout
    from cplib.hybrid.layout import SequenceLayout
    from cplib.strategy.calibration import default_for

    model = _model()
    ids = torch.randint(0, 256, (1, s), generator=torch.Generator().manual_seed(1))
    times = interleaved_wall_cpu({way: (lambda w=way: _step(model, ids, ids, w))
                                  for way in WAYS}, ITERS)
    received = {}
    for way in WAYS:
        counter = _Received(dist.get_world_size())
        _step(model, ids, ids, way, counter)
        received[way] = counter.bytes
    layout = SequenceLayout("", dist.get_world_size(), dist.get_rank(), s, Layout.HEAD_TAIL)
    shape = DeltaShape(1, 4, 8, 32, 32, 1, 4)
    costs = exchange_costs(layout, shape, default_for("cpu"), WIDENED_UNIT_S["cpu"])
    return {"times": times, "received": received, "auto": choose_exchange(layout, shape, "cpu"),
            "predicted": {w: costs[w]["time_s"] for w in WAYS}}


def _one_process(s: int) -> float:
    model = _model()
    ids = torch.randint(0, 256, (1, s), generator=torch.Generator().manual_seed(1))
    return interleaved_wall_cpu({"one": lambda: _step(model, ids, ids)}, ITERS)["one_cpu"]


def main() -> None:
    rows, payload = [], {"N": N, "iters": ITERS, "rows": []}
    for s in SEQS:
        ideal = run_on_ranks(1, _one_process, s)[0]
        per_rank = run_on_ranks(N, _measure, s)
        row = {"S": s, "one_process_cpu_ms": ideal * 1e3, "auto": per_rank[0]["auto"]}
        for w in WAYS:
            row[f"{w}_ms"] = max(r["times"][w] for r in per_rank) * 1e3
            row[f"{w}_cpu_ms"] = max(r["times"][f"{w}_cpu"] for r in per_rank) * 1e3
            row[f"{w}_kB"] = max(r["received"][w] for r in per_rank) / 1e3
            row[f"{w}_predicted_ms"] = per_rank[0]["predicted"][w] * 1e3
        payload["rows"].append(row)
        rows.append((s, row["one_process_cpu_ms"], row["heads_ms"], row["heads_cpu_ms"],
                     row["state_ms"], row["state_cpu_ms"], row["heads_kB"], row["state_kB"],
                     f"{row['auto']} ({row['heads_predicted_ms']:.2f} / "
                     f"{row['state_predicted_ms']:.2f})"))
    print_table(f"Qwen3-Next-shaped (3 Gated DeltaNet + 1 attention layer, hidden 128, linear "
                f"heads 4 k / 8 v, d 32) fwd+bwd with labels, N={N} head-tail, 1 thread/rank, "
                f"median of {ITERS}",
                ["S", "one process CPU ms", "heads wall ms", "heads CPU ms", "state wall ms",
                 "state CPU ms", "heads kB recv/rank", "state kB recv/rank",
                 "auto (predicted ms/layer heads / state)"], rows)
    write_json("bench_hybrid", payload)
    plot("bench_hybrid", "hybrid step under CP: bytes received per rank", "S", "kB",
         {w: ([str(r["S"]) for r in payload["rows"]], [r[f"{w}_kB"] for r in payload["rows"]])
          for w in WAYS}, kind="bar")
    print(machine())


if __name__ == "__main__":
    main()
