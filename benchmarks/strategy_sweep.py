"""The rank side of bench_strategy.py: on N gloo ranks, for each configuration,
the calibration (timed), the model's candidates and its choice, and every
candidate's forward + backward timed round-robin (one warm-up round, then
``iters`` rounds; a barrier before and after each run, so each run's time is
the slowest rank's), with the bytes it sent. Rank 0 appends each finished
configuration to a JSON-lines file, so a run that stops can resume."""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

__all__ = ["Config", "run_configs", "documents_of", "window_of"]


@dataclass(frozen=True)
class Config:
    name: str
    seq_len: int
    world_size: int
    q_heads: int
    kv_heads: int
    causal: bool
    mask: str  # "dense", "documents" or "window"
    head_dim: int = 32
    batch: int = 1


def documents_of(c: Config) -> list[int] | None:
    """8 packed documents of seeded random lengths (the same in every run)."""
    if c.mask != "documents":
        return None
    rng = random.Random(c.seq_len)
    cuts = sorted(rng.sample(range(1, c.seq_len), 7))
    return [0] + cuts + [c.seq_len]


def window_of(c: Config) -> tuple[int, int] | None:
    """A window of S/8 tokens back (and forward when not causal)."""
    if c.mask != "window":
        return None
    w = c.seq_len // 8
    return (w, 0) if c.causal else (w, w)


def _workload(c: Config):
    from cplib.strategy.explain import workload_of

    return workload_of(seq_len=c.seq_len, q_heads=c.q_heads, head_dim=c.head_dim,
                       world_size=c.world_size, kv_heads=c.kv_heads, batch=c.batch,
                       dtype=torch.float32, is_causal=c.causal, window=window_of(c),
                       cu_seqlens=documents_of(c), device_type="cpu")


def _rows(c: Config, cand) -> torch.Tensor:
    from cplib.ulysses.usp_layout import usp_shard_ranges

    rank = dist.get_rank()
    ranges = usp_shard_ranges(c.seq_len, c.world_size, cand.ulysses_degree, rank,
                              cand.layout != "sequential")
    return torch.cat([torch.arange(s, s + n) for s, n in ranges])


def _step(c: Config, cand, full: list[torch.Tensor]):
    """One fwd+bwd of ``cand`` on this rank's rows of ``full`` (q, k, v)."""
    import cplib
    from cplib.ulysses.usp_layout import usp_groups

    groups = usp_groups(dist.group.WORLD, cand.ulysses_degree)  # collective once
    idx = _rows(c, cand)
    q, k, v = (t[:, :, idx].contiguous().requires_grad_() for t in full)
    docs = documents_of(c)
    extras = dict(cu_seqlens=None if docs is None else torch.tensor(docs),
                  window=window_of(c), seq_len=c.seq_len)
    balanced = cand.layout != "sequential"

    def run() -> None:
        if cand.family == "ring":
            out, _ = cplib.ring_sdpa(q, k, v, groups.ring_group, is_causal=c.causal,
                                     load_balanced=balanced, rotate=cand.rotate, **extras)
        elif cand.family == "ulysses":
            out, _ = cplib.ulysses_sdpa(q, k, v, groups.ulysses_group, is_causal=c.causal,
                                        **extras)
        else:
            out, _ = cplib.usp_sdpa(q, k, v, groups.ulysses_group, groups.ring_group,
                                    is_causal=c.causal, load_balanced=balanced,
                                    rotate=cand.rotate, **extras)
        out.backward(torch.ones_like(out))
        q.grad = k.grad = v.grad = None
    return run


def _timed(run) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    run()
    dist.barrier()
    return time.perf_counter() - t0


def _bytes_sent() -> int:
    from cplib.comm.native import ops

    return ops.ring_debug_bytes_sent(True) + ops.ulysses_debug_bytes_sent(True)


def _one_config(c: Config, iters: int) -> dict:
    from cplib.strategy.candidates import candidates_for
    from cplib.strategy.choice import _calibrations, calibration_for, choose
    from cplib.strategy.explain import DEFAULT_MARGIN, constraints_of

    w = _workload(c)
    dist.barrier()  # ranks arrive apart after the spawn: that wait is not calibration
    t0 = time.perf_counter()
    fresh = not any(k[2] == c.head_dim for k in _calibrations)
    cal = calibration_for(dist.group.WORLD.group_name, torch.device("cpu"), c.head_dim,
                          torch.float32)
    calib_s = time.perf_counter() - t0 if fresh else None
    # What strategy="auto" chooses: its default margin over torch's default.
    choice = choose(w, cal, constraints_of(None, None, None, c.world_size,
                                           margin=DEFAULT_MARGIN))
    cands = candidates_for(w)
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(c.batch, h, c.seq_len, c.head_dim, generator=g)
            for h in (c.q_heads, c.kv_heads, c.kv_heads)]
    runs = [_step(c, cand, full) for cand in cands]
    times: list[list[float]] = [[] for _ in cands]
    sent = [0] * len(cands)
    for round_ in range(iters + 1):
        for i, run in enumerate(runs):
            _bytes_sent()
            t = _timed(run)
            if round_ == 0:
                sent[i] = _bytes_sent()
            else:
                times[i].append(t)
    preds = {r.candidate: r.prediction for r in choice.rows}
    return dict(config=asdict(c), calibration=cal.as_dict(), calibration_s=calib_s,
                chosen=choice.chosen.name,
                candidates=[dict(name=cand.name, family=cand.family, rotate=cand.rotate,
                                 ulysses_degree=cand.ulysses_degree,
                                 measured_s=statistics.median(times[i]), runs_s=times[i],
                                 bytes_sent=sent[i],
                                 predicted_s=preds[cand].time_s,
                                 predicted_bytes=preds[cand].bytes_sent,
                                 predicted_memory=preds[cand].memory_bytes)
                            for i, cand in enumerate(cands)])


def run_configs(configs: list[Config], iters: int, out_path: str) -> list[dict]:
    """Every configuration in turn on these ranks; each finished one is
    appended (rank 0) to ``out_path`` as a JSON line. Returns this rank's
    results (each rank's timings are barrier-to-barrier: the slowest rank's)."""
    done = []
    for c in configs:
        t0 = time.perf_counter()
        result = _one_config(c, iters)
        # The slowest rank's time and calibration, the most bytes any rank sent.
        mine = [(x["measured_s"], x["bytes_sent"]) for x in result["candidates"]]
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, (mine, result["calibration_s"]))
        for i, cand in enumerate(result["candidates"]):
            cand["measured_s"] = max(e[0][i][0] for e in every)
            cand["bytes_sent"] = max(e[0][i][1] for e in every)
        if result["calibration_s"] is not None:
            result["calibration_s"] = max(e[1] for e in every)
        result["config_s"] = time.perf_counter() - t0
        if dist.get_rank() == 0:
            with open(out_path, "a") as f:
                f.write(json.dumps(result) + "\n")
            print(f"  {c.name}: {result['config_s']:.1f} s, auto -> {result['chosen']}",
                  flush=True)
        done.append(result)
    return done

