"""The rank side of bench_strategy.py: on N gloo ranks, for each configuration,
the calibration (timed), the model's candidates and its choice, and, timed
round-robin (one warm-up round, then ``iters`` rounds; a barrier before and
after each run, so each run's time is the slowest rank's):

* every candidate's forward + backward, through its op (``ring_sdpa``,
  ``ulysses_sdpa``, ``usp_sdpa``) on shards in its layout;
* "auto": ``F.scaled_dot_product_attention`` inside
  ``context_parallel(..., strategy=AutoStrategy(attention=...))``, which
  chooses (on entry, once) and runs what it chose: auto's own time;
* "default": the same call inside ``context_parallel(...,
  rotate_method="allgather")``, torch's prototype default (ring, all-gather,
  head-tail) through the same front end.

The contexts are entered and left outside the timed window (the sharding is
per batch, the attention per layer). Rank 0 appends each finished
configuration to a JSON-lines file, so a run that stops can resume."""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

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
    from cplib.ring.placement import document_placement
    from cplib.ulysses.usp_layout import usp_shard_ranges

    rank = dist.get_rank()
    if cand.layout == "placement":
        ranges = document_placement(documents_of(c), c.world_size)[rank]
    else:
        ranges = usp_shard_ranges(c.seq_len, c.world_size, cand.ulysses_degree, rank,
                                  cand.layout != "sequential")
    return torch.cat([torch.arange(s, s + n) for s, n in ranges])


def _step(c: Config, cand, full: list[torch.Tensor]) -> Callable[[], None]:
    """One fwd+bwd of ``cand`` on this rank's rows of ``full`` (q, k, v)."""
    import cplib
    from cplib.ulysses.usp_layout import usp_groups

    groups = usp_groups(dist.group.WORLD, cand.ulysses_degree)  # collective once
    idx = _rows(c, cand)
    q, k, v = (t[:, :, idx].contiguous().requires_grad_() for t in full)
    docs = documents_of(c)
    # As the front end passes them: the global length only with documents
    # (the shards are even otherwise).
    extras = dict(cu_seqlens=None if docs is None else torch.tensor(docs),
                  window=window_of(c), seq_len=None if docs is None else c.seq_len)
    balanced = cand.layout != "sequential"

    def run() -> None:
        if cand.family == "ring":
            out, _ = cplib.ring_sdpa(q, k, v, groups.ring_group, is_causal=c.causal,
                                     load_balanced=balanced, rotate=cand.rotate,
                                     placement=cand.layout == "placement", **extras)
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


class _InContext:
    """SDPA fwd+bwd inside ``context_parallel(**options)`` on clones of
    ``full``: ``enter()`` shards (untimed), ``run()`` is the timed call,
    ``leave()`` exits the context."""

    def __init__(self, c: Config, full: list[torch.Tensor], **options):
        self.c, self.full, self.options = c, full, options
        self.mesh = torch.distributed.device_mesh.DeviceMesh(
            "cpu", list(range(dist.get_world_size())))
        self.handle = None

    def enter(self) -> None:
        import cplib

        docs = documents_of(self.c)
        self.bufs = [t.clone() for t in self.full]
        self.cm = cplib.context_parallel(
            self.mesh, buffers=self.bufs, buffer_seq_dims=[2, 2, 2],
            cu_seqlens=None if docs is None else torch.tensor(docs), window=window_of(self.c),
            **self.options)
        self.handle = self.cm.__enter__()
        for t in self.bufs:
            t.requires_grad_(True)

    def run(self) -> None:
        q, k, v = self.bufs
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.c.causal,
                                             enable_gqa=self.c.q_heads != self.c.kv_heads)
        out.backward(torch.ones_like(out))
        for t in self.bufs:
            t.grad = None

    def leave(self) -> None:
        for t in self.bufs:
            t.requires_grad_(False)
        self.cm.__exit__(None, None, None)


def _timed(run: Callable[[], None]) -> tuple[float, float]:
    """(wall seconds barrier to barrier: the slowest rank's; this rank's CPU seconds)."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    run()
    c1 = time.process_time()
    dist.barrier()
    return time.perf_counter() - t0, c1 - c0


def _bytes_sent() -> int:
    from cplib.comm.native import ops

    return ops.ring_debug_bytes_sent(True) + ops.ulysses_debug_bytes_sent(True)


def _one_config(c: Config, iters: int) -> dict:
    import cplib
    from cplib.strategy.candidates import candidates_for
    from cplib.strategy.choice import _calibrations, calibration_for, choose
    from cplib.strategy.explain import DEFAULT_MARGIN, constraints_of

    w = _workload(c)
    load = os.getloadavg()[0]
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
    shape = cplib.AttentionShape(q_heads=c.q_heads, kv_heads=c.kv_heads, head_dim=c.head_dim,
                                 dtype=torch.float32, is_causal=c.causal, batch=c.batch)
    contexts = {"auto": _InContext(c, full, strategy=cplib.AutoStrategy(attention=shape)),
                "default": _InContext(c, full, rotate_method="allgather", load_balance=True)}
    names = [cand.name for cand in cands] + list(contexts)
    runs = [_step(c, cand, full) for cand in cands] + [ctx.run for ctx in contexts.values()]
    wall: list[list[float]] = [[] for _ in names]
    cpu: list[list[float]] = [[] for _ in names]
    sent = [0] * len(names)
    auto_chose = None
    for round_ in range(iters + 1):
        for i, (name, run) in enumerate(zip(names, runs)):
            ctx = contexts.get(name)
            if ctx is not None:
                ctx.enter()
            _bytes_sent()
            t, cpu_s = _timed(run)
            if ctx is not None:
                if name == "auto" and auto_chose is None:
                    auto_chose = cplib.explain(ctx.handle)[0].chosen.name
                ctx.leave()
            if round_ == 0:
                sent[i] = _bytes_sent()
            else:
                wall[i].append(t)
                cpu[i].append(cpu_s)
    preds = {r.candidate.name: r.prediction for r in choice.rows}

    def record(i: int, name: str) -> dict:
        p = preds.get(name)
        out = dict(name=name, measured_s=statistics.median(wall[i]), runs_s=wall[i],
                   cpu_s=statistics.median(cpu[i]), bytes_sent=sent[i])
        if p is not None:
            out.update(predicted_s=p.time_s, predicted_compute_s=p.compute_s,
                       predicted_exposed_s=p.exposed_s, predicted_fixed_s=p.fixed_s,
                       predicted_bytes=p.bytes_sent, predicted_memory=p.memory_bytes)
        return out
    return dict(config=asdict(c), calibration=cal.as_dict(), calibration_s=calib_s,
                chosen=choice.chosen.name, auto_chose=auto_chose,
                load=[load, os.getloadavg()[0]],
                candidates=[record(i, n) for i, n in enumerate(names[:len(cands)])],
                auto=record(len(cands), "auto"), default=record(len(cands) + 1, "default"))


def run_configs(configs: list[Config], iters: int, out_path: str) -> list[dict]:
    """Every configuration in turn on these ranks; each finished one is
    appended (rank 0) to ``out_path`` as a JSON line. Returns this rank's
    results (each rank's timings are barrier-to-barrier: the slowest rank's;
    CPU seconds: the busiest rank's, and their sum over the ranks)."""
    done = []
    for c in configs:
        t0 = time.perf_counter()
        result = _one_config(c, iters)
        entries = result["candidates"] + [result["auto"], result["default"]]
        mine = [(x["measured_s"], x["bytes_sent"], x["cpu_s"]) for x in entries]
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, (mine, result["calibration_s"]))
        for i, x in enumerate(entries):
            x["measured_s"] = max(e[0][i][0] for e in every)
            x["bytes_sent"] = max(e[0][i][1] for e in every)
            x["cpu_s"] = max(e[0][i][2] for e in every)
            x["cpu_sum_s"] = sum(e[0][i][2] for e in every)
        if result["calibration_s"] is not None:
            result["calibration_s"] = max(e[1] for e in every)
        result["config_s"] = time.perf_counter() - t0
        if dist.get_rank() == 0:
            with open(out_path, "a") as f:
                f.write(json.dumps(result) + "\n")
            print(f"  {c.name}: {result['config_s']:.1f} s, auto -> {result['auto_chose']} "
                  f"(load {result['load'][0]:.1f}-{result['load'][1]:.1f})", flush=True)
        done.append(result)
    return done
