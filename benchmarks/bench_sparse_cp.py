"""One DeepSeek Sparse Attention layer (transformers' DeepseekV32Attention,
its lightning indexer and MLA) under context parallelism against one
process and against gathering the full expanded K/V (cplib/sparse/,
cplib/integrations/transformers/sparse/).

What travels per token is DeepSeek-V3.2's: the indexer's keys (128 values:
``index_head_dim``) and the MLA latent (576: ``kv_lora_rank`` 512 + the
roped key 64), with its ``index_topk`` of 2048; the heads are fewer (4
attention heads, 4 indexer heads: the CPU's share of the compute), which
changes neither of those bytes. Gathering the expanded K/V instead moves
every head's key and value, 128 x (192 + 128) values a token at
DeepSeek-V3.2's 128 heads (the figure of comparison; at this layer's 4
heads it would be 4 x 320).

Per sequence length, N gloo ranks, one thread each, fp32, fwd+bwd of the
layer (head-tail shards): the bytes a rank receives (forward and backward,
counted at cplib's all-to-alls), the way the latents travelled (gather or
fetch: the other way's bytes beside it), the wall time of the slowest rank
and the CPU seconds of the busiest, and one process's fwd+bwd where it fits
(transformers' indexer broadcasts its keys to every query: S x 128 x S
floats, 8.6 GB at S=4K).

    python benchmarks/bench_sparse_cp.py
    CPLIB_BENCH_SEQS=1024,2048 CPLIB_BENCH_N=2 python benchmarks/bench_sparse_cp.py
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

N = int(os.environ.get("CPLIB_BENCH_N", "4"))
SEQS = [int(x) for x in os.environ.get("CPLIB_BENCH_SEQS", "1024,2048,4096,8192,16384").split(",")]
ITERS = int(os.environ.get("CPLIB_BENCH_ITERS", "2"))
ONE_PROCESS_MAX = int(os.environ.get("CPLIB_BENCH_ONE_PROCESS_MAX", "2048"))
HEADS, V32_HEADS = 4, 128
LATENT, INDEX_DIM, QK_DIM, V_DIM = 576, 128, 192, 128


def _layer():
    from transformers import DeepseekV32Config
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as m

    import cplib.hf  # noqa: F401  (installs the integration)

    config = DeepseekV32Config(
        hidden_size=256, num_attention_heads=HEADS, num_key_value_heads=HEADS, q_lora_rank=128,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=V_DIM,
        index_n_heads=HEADS, index_head_dim=INDEX_DIM, index_topk=2048, attention_dropout=0.0,
        max_position_embeddings=max(SEQS), attn_implementation="sdpa")
    torch.manual_seed(0)
    return m.DeepseekV32Attention(config, 0), m.DeepseekV32RotaryEmbedding(config)


class _Received(TorchDispatchMode):
    """Float bytes this rank receives from the others in cplib's all-to-alls."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if str(func).startswith("cplib_c.c10d_all_to_all") and args[0].is_floating_point():
            outs, me = args[1], dist.get_rank()
            row = out[0].numel() * out.element_size() if out.shape[0] else 0
            self.bytes += (sum(outs) - outs[me]) * row
        return out


def _full_step(layer, rope, hidden, pos):
    h = hidden.detach().requires_grad_()
    cos, sin = rope(h, pos)
    s = h.shape[1]
    mask = torch.ones(s, s, dtype=torch.bool).tril()[None, None]
    out, _ = layer(h, (cos, sin), mask, position_ids=pos)
    out.sum().backward()


def _cp_step(layer, rope, hidden, pos, received=None):
    h = hidden.detach().requires_grad_()
    cos, sin = rope(h, pos)
    out, _ = layer(h, (cos, sin), None, position_ids=pos)
    fwd = received.bytes if received is not None else 0
    out.sum().backward()
    return fwd


def _rank(seq: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import cplib
    from cplib.integrations.transformers.sparse import attend

    torch.set_num_threads(1)
    layer, rope = _layer()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(1)
    hidden, pos = torch.randn(1, seq, 256, generator=g), torch.arange(seq)[None]
    plans = []
    with cplib.context_parallel(mesh, buffers=[hidden, pos], buffer_seq_dims=[1, 1],
                                load_balance=True):
        original = attend.plan_rows

        def recording(*args, **kwargs):
            plans.append(original(*args, **kwargs))
            return plans[-1]

        attend.plan_rows = recording
        try:
            with _Received() as received:
                fwd = _cp_step(layer, rope, hidden, pos, received)
            times = interleaved_wall_cpu({"cp": lambda: _cp_step(layer, rope, hidden, pos)},
                                         ITERS)
        finally:
            attend.plan_rows = original
    plan = plans[0]
    return {"fwd": fwd, "total": received.bytes, "strategy": plan.strategy,
            "latents": plan.received, "other": plan.other, **times}


def _one_process(seq: int) -> float | None:
    if seq > ONE_PROCESS_MAX:
        return None
    from common import timeit

    torch.set_num_threads(1)
    layer, rope = _layer()
    hidden = torch.randn(1, seq, 256, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(seq)[None]
    return timeit(lambda: _full_step(layer, rope, hidden, pos), warmup=1, iters=ITERS)


def _expanded(seq: int, heads: int) -> int:
    """Bytes a rank receives gathering every other rank's expanded K/V
    (fp32), forward; the backward's reduce-scatter sends as many back."""
    return (seq - seq // N) * heads * (QK_DIM + V_DIM) * 4


def main() -> None:
    rows, out = [], []
    for seq in SEQS:
        per_rank = run_on_ranks(N, _rank, seq)
        worst = max(per_rank, key=lambda r: r["total"])
        one = _one_process(seq)
        v32 = _expanded(seq, V32_HEADS)
        rec = {"seq": seq, "n": N, "one_process_s": one, "expanded_v32_fwd": v32,
               "expanded_layer_fwd": _expanded(seq, HEADS),
               "cp_s": max(r["cp"] for r in per_rank),
               "cp_cpu_s": max(r["cp_cpu"] for r in per_rank),
               **{k: worst[k] for k in ("fwd", "total", "strategy", "latents", "other")}}
        out.append(rec)
        rows.append([seq, N, rec["fwd"] / 2**20, rec["total"] / 2**20, rec["strategy"],
                     rec["other"] / 2**20, v32 / 2**20, rec["fwd"] / v32,
                     "-" if one is None else one, rec["cp_s"], rec["cp_cpu_s"]])
    print_table(f"DeepSeek Sparse Attention layer under CP, N={N} (bytes per rank, MiB)",
                ["S", "N", "fwd recv", "fwd+bwd recv", "latents by", "other way",
                 "expanded K/V (V3.2, fwd)", "fwd / expanded", "one process s", "CP wall s",
                 "CP cpu s"], rows)
    write_json("bench_sparse_cp", {"machine": machine(), "n": N, "iters": ITERS, "rows": out})
    plot("bench_sparse_cp", f"bytes received per rank and layer, N={N}", "S", "MiB",
         {"cplib fwd": (SEQS, [r["fwd"] / 2**20 for r in out]),
          "cplib fwd+bwd": (SEQS, [r["total"] / 2**20 for r in out]),
          "expanded K/V, V3.2 heads (fwd)": (SEQS, [r["expanded_v32_fwd"] / 2**20
                                                   for r in out])})


if __name__ == "__main__":
    main()
