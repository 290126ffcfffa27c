"""The Hugging Face path (``attn_implementation="cplib"``) against the SDPA
route (``attn_implementation="sdpa"``, routed to the ring by
``cplib.context_parallel``) on CPU, N = 2 gloo ranks, one thread each: a
tiny Llama forward + backward under the context, per rank, at a short
sequence (per-call overhead dominates) and a longer one (attention
dominates). Both paths run the same ring op; the difference is what each
adds around it per attention call.

    python benchmarks/bench_hf_cpu.py
    CPLIB_BENCH_ITERS=9 python benchmarks/bench_hf_cpu.py
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from common import interleaved, machine, plot, print_table, run_on_ranks, write_json  # noqa: E402

N = 2
SEQS = [int(x) for x in os.environ.get("CPLIB_BENCH_SEQS", "256,4096").split(",")]
ITERS = int(os.environ.get("CPLIB_BENCH_ITERS", "7"))
LAYERS = 4


def _model(impl: str, s: int):
    import transformers as tf

    import cplib.hf  # noqa: F401

    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=LAYERS, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=s, attn_implementation=impl)
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(cfg)


def _time(s: int) -> dict[str, float]:
    import cplib
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh("cpu", list(range(dist.get_world_size())))
    models = {impl: _model(impl, s) for impl in ("sdpa", "cplib")}
    ids = torch.randint(0, 128, (1, s), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(s).view(1, s)

    def step(model):
        bufs = [ids.clone(), pos.clone()]
        with cplib.context_parallel(mesh, buffers=bufs, buffer_seq_dims=[1, 1],
                                    no_restore_buffers=set(bufs), load_balance=True):
            model(input_ids=bufs[0], position_ids=bufs[1]).logits.square().mean().backward()

    fns = {impl: (lambda m=m: step(m)) for impl, m in models.items()}
    return interleaved(fns, ITERS, sync=dist.barrier)


def main() -> None:
    rows, payload = [], {"N": N, "layers": LAYERS, "rows": []}
    for s in SEQS:
        per_rank = run_on_ranks(N, _time, s)
        t = {impl: max(r[impl] for r in per_rank) for impl in ("sdpa", "cplib")}
        ratio = t["cplib"] / t["sdpa"]
        rows.append((s, t["sdpa"] * 1e3, t["cplib"] * 1e3, ratio))
        payload["rows"].append(dict(S=s, sdpa_ms=t["sdpa"] * 1e3, cplib_ms=t["cplib"] * 1e3,
                                    ratio=ratio))
    print_table(f"tiny Llama ({LAYERS} layers, hidden 128, 8 q / 4 kv heads) fwd+bwd under "
                f"context_parallel, N={N}, 1 thread/rank, median of {ITERS}",
                ["S", "sdpa route ms", "cplib HF path ms", "cplib / sdpa"], rows)
    write_json("bench_hf_cpu", payload)
    plot("bench_hf_cpu", "HF path / SDPA route (fwd+bwd time)", "S", "ratio",
         {"cplib / sdpa": ([str(r[0]) for r in rows], [r[3] for r in rows])}, kind="bar")
    print(machine())


if __name__ == "__main__":
    main()
