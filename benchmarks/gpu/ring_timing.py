"""bench_ring_gpu.py's measurements, each one cell: full SDPA in the main
thread on one backend, cplib's ring and torch's own ring on N threaded ranks
sharing the device (every rank's work timed, barrier and device
synchronisation around each step), and the merge kernel's bandwidth against a
device-to-device copy. Each time is the median of ``Setup.iters`` steps after
``Setup.warmup`` warm-ups; a cell that fails returns ``"error: ..."``.

Process-global state (SDPA backend flags, torch's _cp_options) is set in the
main thread only, never in the rank threads. Imported by
benchmarks/bench_ring_gpu.py, which puts tests/support/ (the threaded group's
runner) on sys.path first."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

import cplib
from cplib.merge.op import combine_partials_
from common import timeit
from harness import run_threaded
from ring_blocks import plan_calls, time_blocks
from ring_profile import counting_wire, profiled_step

ROTATIONS = ["p2p", "alltoall", "allgather"]
TORCH_ROTATIONS = ["alltoall", "allgather"]


@dataclass(frozen=True)
class Config:
    s: int
    n: int
    causal: bool
    hq: int
    hkv: int

    @property
    def label(self) -> str:
        gqa = f" GQA {self.hq}/{self.hkv}" if self.hq != self.hkv else ""
        return f"S={self.s} N={self.n} {'causal' if self.causal else 'non-causal'}{gqa}"


@dataclass
class Setup:
    device: torch.device
    dtype: torch.dtype
    b: int
    d: int
    warmup: int
    iters: int
    backends: list[str]      # cplib / full SDPA backends
    torch_ops: list[str]     # torch CP ops
    block_backends: list[str] = dataclasses.field(default_factory=lambda: ["cpu"])  # T_blocks


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _err(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    # run_threaded's AssertionError starts with a summary line; the cause is
    # the last line of the first rank's traceback.
    cause = next((ln for ln in reversed(text) if ln and not ln.startswith(" ")), "")
    return f"error: {type(exc).__name__}: {cause[:160]}"


def inputs(cfg: Config, st: Setup) -> list[torch.Tensor]:
    g = torch.Generator(device=st.device).manual_seed(cfg.s + cfg.hkv)
    shapes = [(st.b, cfg.hq, cfg.s, st.d), (st.b, cfg.hkv, cfg.s, st.d),
              (st.b, cfg.hkv, cfg.s, st.d), (st.b, cfg.hq, cfg.s, st.d)]
    return [torch.randn(sh, generator=g, device=st.device, dtype=st.dtype) for sh in shapes]


def _shard(t: torch.Tensor, rank: int, n: int, lb: bool) -> torch.Tensor:
    if not lb:
        return t.chunk(n, dim=2)[rank].contiguous()
    c = t.chunk(2 * n, dim=2)
    return torch.cat([c[rank], c[2 * n - 1 - rank]], dim=2)


# ---------------------------------------------------------------- full SDPA (main thread)


def _kernel(backend: str):
    from torch.nn.attention import SDPBackend
    return {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]


def time_full(cfg: Config, st: Setup, backend: str, full: list[torch.Tensor]) -> float | str:
    """One full-sequence SDPA forward+backward, on one backend (main thread)."""
    q, k, v, dout = (t.detach().requires_grad_(i < 3) for i, t in enumerate(full))

    def timed(k, v, gqa):
        def step():
            q.grad = k.grad = v.grad = None
            F.scaled_dot_product_attention(q, k, v, is_causal=cfg.causal,
                                           enable_gqa=gqa).backward(dout)
        if st.device.type != "cuda":
            return timeit(step, warmup=st.warmup, iters=st.iters)
        from torch.nn.attention import sdpa_kernel
        with sdpa_kernel([_kernel(backend)]):
            return timeit(step, warmup=st.warmup, iters=st.iters,
                          sync=lambda: _sync(st.device))
    try:
        return timed(k, v, cfg.hq != cfg.hkv)
    except RuntimeError as exc:
        if cfg.hq == cfg.hkv:
            return _err(exc)
    # A backend that refuses enable_gqa: the same call on K/V expanded
    # beforehand (same attention work, K/V read Hq/Hkv times).
    groups = cfg.hq // cfg.hkv
    kx, vx = (t.detach().repeat_interleave(groups, dim=1).requires_grad_(True) for t in (k, v))
    try:
        return timed(kx, vx, False)
    except RuntimeError as exc:
        return _err(exc)


def time_plan_blocks(cfg: Config, st: Setup, backends: list[str]) -> dict:
    """T_blocks (ring_blocks.py) on each backend: its dict, or the error."""
    calls = plan_calls(cfg.s, cfg.n, cfg.causal)
    out: dict[str, Any] = {}
    for backend in backends:
        try:
            out[backend] = time_blocks(calls, cfg.n, st.b, cfg.hq, st.d, st.dtype, st.device,
                                       backend, functools.partial(timeit, warmup=st.warmup,
                                                                  iters=st.iters),
                                       lambda: _sync(st.device))
        except RuntimeError as exc:
            out[backend] = _err(exc)
    return out


# ---------------------------------------------------------------- rings (rank threads)


def _barrier() -> None:
    dist.all_reduce(torch.zeros(1))


def _time_ranks(step: Callable[[], Any], st: Setup) -> float:
    """Median wall time of a step of every rank: the GPU is shared, so the
    device synchronisation and barrier around it take in all ranks' work."""
    def sync():
        _sync(st.device)
        _barrier()
    return timeit(step, warmup=st.warmup, iters=st.iters, sync=sync)


def _all_finite(*ts: torch.Tensor) -> bool:
    flag = torch.tensor([float(all(bool(torch.isfinite(t).all()) for t in ts))])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return flag.item() == 1.0


def _profile(step: Callable[[], Any], st: Setup, prof: dict | None) -> dict | None:
    """One more step under the profiler (ring_profile.py), when ``prof``
    (shared by the cell's ranks) is given; rank 0 returns its split."""
    if prof is None:
        return None
    return profiled_step(step, lambda: _sync(st.device), _barrier, st.device, prof["shared"],
                         prof["wire"])


def cplib_rank(cfg: Config, st: Setup, full: list[torch.Tensor], backend: str | None,
               rotate: str, prof: dict | None = None) -> tuple[float, bool, dict | None]:
    rank, n = dist.get_rank(), dist.get_world_size()
    lb = cfg.causal
    q, k, v, dout = (_shard(t, rank, n, lb) for t in full)
    for t in (q, k, v):
        t.requires_grad_(True)
    last: list[torch.Tensor] = []

    def step():
        q.grad = k.grad = v.grad = None
        out, _ = cplib.ring_sdpa(q, k, v, dist.group.WORLD, is_causal=cfg.causal,
                                 load_balanced=lb, rotate=rotate, backend=backend)
        out.backward(dout)
        last[:] = [out.detach()]
    seconds = _time_ranks(step, st)
    return seconds, _all_finite(last[0], q.grad, k.grad, v.grad), _profile(step, st, prof)


def llama3_rank(cfg: Config, st: Setup, full: list[torch.Tensor],
                prof: dict | None = None) -> tuple[float, bool, dict | None]:
    """cplib's all-gather path (cplib/ring/allgather.py): K/V gathered once,
    one call per query chunk, no merge."""
    from cplib.ring.allgather import allgather_sdpa
    rank, n = dist.get_rank(), dist.get_world_size()
    lb = cfg.causal
    q, k, v, dout = (_shard(t, rank, n, lb) for t in full)
    for t in (q, k, v):
        t.requires_grad_(True)
    last: list[torch.Tensor] = []

    def step():
        q.grad = k.grad = v.grad = None
        out = allgather_sdpa(q, k, v, dist.group.WORLD, is_causal=cfg.causal, load_balanced=lb)
        out.backward(dout)
        last[:] = [out.detach()]
    seconds = _time_ranks(step, st)
    return seconds, _all_finite(last[0], q.grad, k.grad, v.grad), _profile(step, st, prof)


def _torch_cp_ops(name: str):
    """(forward op, backward op, forward kwargs, backward kwargs from the
    forward's extra outputs, grad_out's keyword) for torch's ring."""
    aten = torch.ops.aten
    if name == "cpu":
        return (aten._scaled_dot_product_flash_attention_for_cpu,
                aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                dict(dropout_p=0.0), lambda rest: dict(dropout_p=0.0))
    if name == "flash":
        return (aten._scaled_dot_product_flash_attention,
                aten._scaled_dot_product_flash_attention_backward.default,
                dict(dropout_p=0.0, scale=None),
                lambda r: dict(cum_seq_q=r[0], cum_seq_k=r[1], max_q=r[2], max_k=r[3],
                               dropout_p=0.0, philox_seed=r[4], philox_offset=r[5], scale=None))
    return (aten._scaled_dot_product_cudnn_attention,
            aten._scaled_dot_product_cudnn_attention_backward.default,
            dict(attn_bias=None, compute_log_sumexp=True, dropout_p=0.0,
                 return_debug_mask=False, scale=None),
            lambda r: dict(philox_seed=r[4], philox_offset=r[5], attn_bias=None, cum_seq_q=r[0],
                           cum_seq_k=r[1], max_q=r[2], max_k=r[3], dropout_p=0.0, scale=None))


def torch_cp_module():
    """torch's private ring functions, or the reason they cannot be used."""
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention as A
        fwd, _bwd, _opts = (A._templated_ring_attention, A._templated_ring_attention_backward,
                            A._cp_options)
        _ = (A._RotateMethod.ALL_TO_ALL, A._RotateMethod.ALL_GATHER)
    except (ImportError, AttributeError) as exc:
        return f"unavailable: {type(exc).__name__}: {exc}"
    first = next(iter(inspect.signature(fwd).parameters))
    if first != "group":
        return f"unavailable: _templated_ring_attention takes '{first}' first, not a group"
    return A


def _torch_rank(cfg: Config, st: Setup, full: list[torch.Tensor], op: str,
                prof: dict | None = None) -> tuple[float, bool, dict | None]:
    A = torch_cp_module()
    rank, n = dist.get_rank(), dist.get_world_size()
    groups = cfg.hq // cfg.hkv
    # torch's ring passes k/v to the fused op as they are: expand GQA heads first.
    q, k, v, dout = (_shard(t if i in (0, 3) else t.repeat_interleave(groups, dim=1),
                            rank, n, cfg.causal) for i, t in enumerate(full))
    fwd, bwd, fwd_kw, bwd_kw = _torch_cp_ops(op)
    group = dist.group.WORLD
    last: list[torch.Tensor] = []

    def step():
        with torch.no_grad():
            out, lse, *rest = A._templated_ring_attention(group, 2, fwd, q, k, v,
                                                          is_causal=cfg.causal, **fwd_kw)
            grads = A._templated_ring_attention_backward(group, 2, bwd, dout, "grad_out", q, k,
                                                         v, out, lse, cfg.causal, **bwd_kw(rest))
        last[:] = [out, *grads[:3]]
    seconds = _time_ranks(step, st)
    return seconds, _all_finite(*last), _profile(step, st, prof)


def run_ring(fn, cfg: Config, st: Setup, full: list[torch.Tensor], *args,
             profile: bool = False) -> float | str | dict:
    """One variant on cfg.n rank threads: seconds, or the error (a rank's
    failure wakes the others, so one variant cannot hang the rest). With
    ``profile``, one more step runs under the profiler and the value is
    ``{"seconds": ..., "profile": split}`` (ring_profile.split, with each
    rank's bytes sent; or ``{"error": ...}``)."""
    try:
        with counting_wire(cfg.n) as wire:
            prof = dict(shared={}, wire=wire) if profile else None
            res = run_threaded(cfg.n, fn, cfg, st, full, *args, prof)
    except Exception as exc:  # noqa: BLE001 - every failure becomes a table cell
        return _err(exc)
    seconds = max(r[0] for r in res)
    if not res[0][1]:
        return f"NaN/inf output after {seconds * 1e3:.2f} ms"
    return dict(seconds=seconds, profile=res[0][2]) if profile else seconds


def time_torch_cp(cfg: Config, st: Setup, full: list[torch.Tensor], op: str,
                  rotate: str, profile: bool = False) -> float | str | dict:
    A = torch_cp_module()
    if isinstance(A, str):
        return A
    opts = A._cp_options
    saved = (opts.enable_load_balance, opts.rotate_method)
    # Global options: set here in the main thread, before the rank threads start.
    opts.enable_load_balance = cfg.causal
    opts.rotate_method = {"alltoall": A._RotateMethod.ALL_TO_ALL,
                          "allgather": A._RotateMethod.ALL_GATHER}[rotate]
    try:
        return run_ring(_torch_rank, cfg, st, full, op, profile=profile)
    finally:
        opts.enable_load_balance, opts.rotate_method = saved


# ---------------------------------------------------------------- merge kernel


def merge_bandwidth(st: Setup, shapes: list[tuple[int, int, int, int]]) -> list[dict | str]:
    """GB/s of cplib.merge_partial_ (fp32 accumulators, block in st.dtype)
    against a device-to-device copy of the same bytes (read + written); an
    error string for a shape whose merged output is not finite."""
    rows = []
    reps = 20 if st.device.type == "cuda" else 2
    for b, h, l, d in shapes:
        g = torch.Generator(device=st.device).manual_seed(l)

        def mk(shape, dt):
            return torch.randn(shape, generator=g, device=st.device).to(dt)
        out, lse = mk((b, h, l, d), torch.float32), mk((b, h, l), torch.float32)
        blk_out, blk_lse = mk((b, h, l, d), st.dtype), mk((b, h, l), torch.float32)
        traffic = 2 * out.nbytes + 2 * lse.nbytes + blk_out.nbytes + blk_lse.nbytes
        src = torch.empty(traffic // 2, dtype=torch.uint8, device=st.device)
        dst = torch.empty_like(src)

        def repeat(fn):
            return lambda: [fn() for _ in range(reps)]
        sync = lambda: _sync(st.device)  # noqa: E731
        iters = max(st.iters, 5)
        t_merge = timeit(repeat(lambda: cplib.merge_partial_(out, lse, blk_out, blk_lse)),
                         iters=iters, sync=sync) / reps
        t_copy = timeit(repeat(lambda: dst.copy_(src)), iters=iters, sync=sync) / reps
        if not (torch.isfinite(out).all() and torch.isfinite(lse).all()):
            # Merges of finite blocks stay finite: anything else is the kernel's fault.
            rows.append(f"error: NaN/inf in the merged output after {t_merge * 1e3:.3f} ms")
            continue
        rows.append(dict(shape=f"{b}x{h}x{l}x{d}", block_dtype=str(st.dtype).split(".")[-1],
                         bytes=traffic, merge_gbps=traffic / t_merge / 1e9,
                         copy_gbps=traffic / t_copy / 1e9, ratio=t_copy / t_merge,
                         **_combine_bandwidth(st, (b, h, l, d), mk, repeat, sync, iters, reps)))
    return rows


def _combine_bandwidth(st: Setup, shape, mk, repeat, sync, iters: int, reps: int) -> dict:
    """What the ring's forward does at its end (merge/partial_sum.h): four
    whole partial outputs in st.dtype with their lse combined into one in
    st.dtype, against a copy of the same bytes."""
    b, h, l, d = shape
    parts = [mk(shape, st.dtype) for _ in range(4)]
    lses = [mk((b, h, l), torch.float32) for _ in range(4)]
    out, lse = torch.empty_like(parts[0]), torch.empty_like(lses[0])
    traffic = sum(t.nbytes for t in (*parts, *lses, out, lse))
    src = torch.empty(traffic // 2, dtype=torch.uint8, device=st.device)
    dst = torch.empty_like(src)
    t = timeit(repeat(lambda: combine_partials_(out, lse, parts, lses, [0] * 4)), iters=iters,
               sync=sync) / reps
    t_copy = timeit(repeat(lambda: dst.copy_(src)), iters=iters, sync=sync) / reps
    if not (torch.isfinite(out).all() and torch.isfinite(lse).all()):
        return dict(combine_gbps=float("nan"), combine_ratio=float("nan"))
    return dict(combine_gbps=traffic / t / 1e9, combine_ratio=t_copy / t)
