"""The strategy model on paper with the built-in H100 defaults
(cplib/strategy/calibration.py: this project's H100 flash rate, NVLink
360 GB/s, InfiniBand NDR 45 GB/s per GPU): the choice and its predicted
time per attention layer (forward + backward, B=1, bf16, causal, head-tail)
for one 8-GPU node and for 4 nodes of 8, S from 8K to 1M, with the attention
shapes of Llama-3-8B (32 q heads, 8 K/V heads, D=128) and Llama-3-70B (64 /
8, D=128), beside the runner-up and torch's prototype default (the ring,
all-gather, head-tail). Nothing is measured.

    python benchmarks/strategy_paper.py            # prints the table, writes JSON
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import print_table, write_json  # noqa: E402

import cplib  # noqa: E402

MODELS = {"Llama-3-8B": (32, 8, 128), "Llama-3-70B": (64, 8, 128)}
TOPOLOGIES = {"1 node x 8": (8, 8), "4 nodes x 8": (32, 8)}
LENGTHS = [8192 * 2 ** i for i in range(8)]  # 8K .. 1M


def _k(s: int) -> str:
    return f"{s // 1048576}M" if s >= 1048576 else f"{s // 1024}K"


def main() -> None:
    rows, payload = [], []
    for topo, (n, per_node) in TOPOLOGIES.items():
        for model, (hq, hkv, d) in MODELS.items():
            for s in LENGTHS:
                choice = cplib.explain(seq_len=s, q_heads=hq, kv_heads=hkv, head_dim=d,
                                       world_size=n, ranks_per_node=per_node,
                                       calibration="h100")
                by_name = {r.candidate.name: r.prediction for r in choice.rows}
                best = choice.prediction
                # The runner-up: the fastest other candidate that is not the
                # chosen one's twin ("alltoall" runs p2p's exchange today).
                second = next(r for r in choice.rows if r.candidate != choice.chosen
                              and r.prediction.time_s != best.time_s)
                default, ring = by_name["ring allgather"], by_name["ring p2p"]
                rows.append((topo, model, _k(s), choice.chosen.name, best.time_s * 1e3,
                             f"{second.candidate.name} ({second.prediction.time_s * 1e3:.4g})",
                             ring.time_s * 1e3, default.time_s * 1e3,
                             default.time_s / best.time_s,
                             best.exposed_s / best.time_s, best.memory_bytes / 2 ** 30))
                payload.append(dict(topology=topo, model=model, seq_len=s,
                                    chosen=choice.chosen.name, time_ms=best.time_s * 1e3,
                                    runner_up=second.candidate.name,
                                    runner_up_ms=second.prediction.time_s * 1e3,
                                    default_ms=default.time_s * 1e3,
                                    ring_p2p_ms=ring.time_s * 1e3,
                                    exposed_share=best.exposed_s / best.time_s,
                                    peak_gib=best.memory_bytes / 2 ** 30))
    print_table("strategy='auto' on paper: H100 defaults, one attention layer fwd+bwd, B=1, "
                "bf16, causal", ["topology", "model", "S", "chosen", "ms", "runner-up (ms)",
                                 "ring p2p ms", "ring allgather ms", "default / chosen",
                                 "exposed share", "peak GiB/rank"], rows)
    print(f"json: {write_json('strategy_paper', {'rows': payload})}")


if __name__ == "__main__":
    main()
