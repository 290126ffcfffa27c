"""ring_sdpa on the threaded process group (all ranks in one process, which is
how several ranks share one GPU): every rotation on CPU here, and where a GPU
is present the CUDA matrix (every rotation x flash/efficient/cuDNN x bf16/fp16
x causal or not x load-balanced or not, at world 2 and 4, judged against fp64
truth: at most 1.5x the single-device error) and a per-step check of each
block backward the ring runs.

SDPA backend flags (``sdpa_kernel``) are global to the process, so they are
only ever set in the main thread, before the rank threads start: the
single-device references are computed there, and the rank threads pass the
backend to ``ring_sdpa`` explicitly.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import cplib
from cplib.comm.native import ops
from ring_cases import ROTATIONS, _run_case, global_tensor, reference, shard_seq

BACKENDS = ["flash", "efficient", "cudnn"]
HALF_DTYPES = [torch.bfloat16, torch.float16]


def needs_cuda(test):
    """A GPU test: marker `cuda` (the GPU check, benchmarks/gpu/run.sh, runs
    exactly those), skipped without a GPU."""
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(),
                                               reason="needs a CUDA GPU (none visible)")(test))


def _check_threaded_cpu() -> int:
    count = 0
    for i, rotate in enumerate(ROTATIONS):
        _run_case(torch.float64, True, True, rotate, 4, 2, 32, 2, 8, i % 2 == 1, seed=i)
        _run_case(torch.float32, False, False, rotate, 2, 1, 64, 1, 7, False, seed=10 + i)
        count += 2
    return count


@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_sdpa_threaded_group_cpu(threaded, world_size):
    assert threaded(world_size, _check_threaded_cpu) == [6] * world_size


# ---------------------------------------------------------------- CUDA matrix


def _kernel(backend: str):
    from torch.nn.attention import SDPBackend
    return {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """sqrt(sum |got - want|^2 / sum |want|^2), NaN-propagating."""
    got, want = got.detach().double().cpu(), want.double().cpu()
    return ((got - want).pow(2).sum() / want.pow(2).sum()).sqrt().item()


def _global_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """The relative error of the whole tensor whose shards the ranks hold."""
    sums = torch.stack([(got.detach().double().cpu() - want).pow(2).sum(), want.pow(2).sum()])
    dist.all_reduce(sums)
    return (sums[0] / sums[1]).sqrt().item()


def _single_lse(q, k, v, causal: bool, backend: str) -> torch.Tensor:
    """The log-sum-exp the backend's own fused op returns for the full sequence."""
    aten = torch.ops.aten
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)[1]
    if backend == "flash":
        return aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False)[1]
    if backend == "efficient":
        lse = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal)[1]
        return lse[..., : q.shape[2]]  # rows are padded to a multiple of 32
    lse = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False)[1]
    return lse.squeeze(-1) if lse.dim() == 4 else lse


@dataclass
class _Case:
    """One ring configuration with its global inputs, fp64 truth and the
    errors of one single-device SDPA call (same backend and dtype)."""
    rotate: str
    causal: bool
    lb: bool
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cot: torch.Tensor
    truth: dict[str, torch.Tensor]
    single_err: dict[str, float]

    def name(self) -> str:
        return (f"{self.rotate} causal={self.causal} lb={self.lb} "
                f"Hq={self.q.shape[1]} Hkv={self.k.shape[1]} S={self.q.shape[2]}")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _make_cases(dtype: torch.dtype, backend: str, n: int, dev: torch.device) -> list[_Case]:
    """Every (rotation, causal, load balance); runs in the main thread, which
    alone sets the SDPA backend flags."""
    from torch.nn.attention import sdpa_kernel
    cases = []
    for i, (rotate, causal, lb) in enumerate(itertools.product(ROTATIONS, (True, False),
                                                               (True, False))):
        # GQA ratios 1, 2, 4; local lengths 128 and 96 (96 = 2 x 48: the
        # efficient kernel's lse then needs padding on the half-block steps);
        # half of each on the CPU, whose bf16 kernel is slow.
        b, hq, hkv, d = 2, 4, (4, 2, 1)[i % 3], 64
        s = (128 if i % 2 == 0 else 96) * n
        if dev.type == "cpu":
            b, s = 1, s // 2
        q, k, v, cot = (global_tensor((b, h, s, d), dtype, 1000 * i + j)
                        for j, h in enumerate((hq, hkv, hkv, hq)))
        out, lse, dq, dk, dv = reference(q, k, v, cot, is_causal=causal, scale=None)
        truth = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
        with sdpa_kernel([_kernel(backend)]):
            qs, ks, vs = (t.to(dev, copy=True).requires_grad_(True) for t in (q, k, v))
            kx, vx = (t.repeat_interleave(hq // hkv, dim=1) for t in (ks, vs))
            single_out = F.scaled_dot_product_attention(qs, kx, vx, is_causal=causal)
            single_out.backward(cot.to(dev))
            with torch.no_grad():
                single_lse = _single_lse(qs, kx, vx, causal, backend)
        _sync(dev)
        single = {"out": single_out, "dq": qs.grad, "dk": ks.grad, "dv": vs.grad}
        errs = {name: _rel_err(t, truth[name]) for name, t in single.items()}
        errs["lse"] = (single_lse.double().cpu() - lse).abs().max().item()
        cases.append(_Case(rotate, causal, lb, q, k, v, cot, truth, errs))
    return cases


# fp32 rounding of an lse around 5-10, which merging adds even where a
# backend's own lse happens to be exact.
_LSE_SLACK = 1e-5


def _check_half_cases(cases: list[_Case], backend: str,
                      dev: torch.device) -> tuple[list[str], list[str]]:
    """Runs every case on this rank; returns (report lines, failures). Errors
    are global (reduced over ranks), so every rank fails the same cases."""
    rank, n = dist.get_rank(), dist.get_world_size()
    report, failures = [], []
    for c in cases:
        shard = lambda t: shard_seq(t, rank, n, c.lb)  # noqa: E731
        ql, kl, vl = (shard(t).to(dev, copy=True).requires_grad_(True)
                      for t in (c.q, c.k, c.v))
        out, lse = cplib.ring_sdpa(ql, kl, vl, dist.group.WORLD, is_causal=c.causal,
                                   load_balanced=c.lb, rotate=c.rotate, backend=backend)
        out.backward(shard(c.cot).to(dev))
        _sync(dev)
        lse_err = (lse.detach().double().cpu() - shard(c.truth["lse"])).abs().max().reshape(1)
        dist.all_reduce(lse_err, op=dist.ReduceOp.MAX)
        errs = {"lse": lse_err.item()}
        for name, got in (("out", out), ("dq", ql.grad), ("dk", kl.grad), ("dv", vl.grad)):
            errs[name] = _global_rel_err(got, shard(c.truth[name]))
        for name, err in errs.items():
            bound = 1.5 * c.single_err[name] + (_LSE_SLACK if name == "lse" else 0.0)
            line = (f"{c.q.dtype} {backend} n={n} {c.name()} {name}: ring {err:.2e} "
                    f"single {c.single_err[name]:.2e}")
            report.append(line)
            if not err <= bound:  # NaN fails too
                failures.append(line)
    return report, failures


@needs_cuda
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_ring_sdpa_cuda_threaded(threaded, world_size, backend, dtype):
    _half_matrix(threaded, world_size, backend, dtype, torch.device("cuda", 0))


def test_ring_sdpa_bf16_threaded_cpu(threaded):
    """The same matrix on the CPU kernel (bf16, world 2)."""
    _half_matrix(threaded, 2, "flash", torch.bfloat16, torch.device("cpu"))


def _half_matrix(threaded, world_size: int, backend: str, dtype: torch.dtype,
                 dev: torch.device) -> None:
    cases = _make_cases(dtype, backend, world_size, dev)
    report, failures = threaded(world_size, _check_half_cases, cases, backend, dev)[0]
    print("\n".join(report))
    assert len(report) == 5 * len(cases) == 5 * 12
    assert not failures, (f"{len(failures)} of {len(report)} checks exceed 1.5x the "
                          "single-device error:\n" + "\n".join(failures))


# ---------------------------------------------------------------- per ring step


@dataclass(frozen=True)
class _Step:
    """Rows of one ring step, mirroring plan_step in csrc/torch/ring/ring_plan.cpp:
    rank `rank`'s q rows [q_start, q_start + q_len) against kv rows
    [kv_start, kv_start + kv_len) of the block that started on rank `src`."""
    rank: int
    i: int
    src: int
    q_start: int
    q_len: int
    kv_start: int
    kv_len: int
    causal: bool


def _ring_steps(n: int, causal: bool, lb: bool, length: int) -> list[_Step]:
    steps = []
    for rank, i in itertools.product(range(n), range(n)):
        src = (rank - i) % n
        full = _Step(rank, i, src, 0, length, 0, length, causal and i == 0)
        if not causal or i == 0:
            steps.append(full)
        elif not lb:
            if src < rank:  # a later rank's keys are all in the future: skipped
                steps.append(full)
        elif src < rank:  # its head chunk precedes ours, its tail follows both
            steps.append(_Step(rank, i, src, 0, length, 0, length // 2, False))
        else:  # both its chunks sit between our head and tail: only our tail attends
            steps.append(_Step(rank, i, src, length // 2, length // 2, 0, length, False))
    return steps


def _block_grads_fp64(q, k, v, dout, out, lse, causal: bool, scale: float):
    """dq, dk, dv of one block of the global attention: the block's keys'
    share of softmax(q k^T) under the GLOBAL lse and out (fp64 math)."""
    groups = q.shape[1] // k.shape[1]
    kx, vx = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    s = q @ kx.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    p = torch.exp(s - lse[..., None])
    dp = dout @ vx.transpose(-1, -2)
    ds = p * (dp - (dout * out).sum(-1, keepdim=True))
    dq = ds @ kx * scale
    dk = ds.transpose(-1, -2) @ q * scale
    dv = p.transpose(-1, -2) @ dout
    fold = lambda g: g.unflatten(1, (k.shape[1], groups)).sum(2)  # noqa: E731
    return dq, fold(dk), fold(dv)


def _step_tolerance(dtype: torch.dtype) -> float:
    # About ten times the single-device error of a bf16 SDPA backward (3e-3
    # measured on an H100): 8 units of roundoff of the dtype.
    return {torch.float64: 1e-10, torch.float32: 1e-5,
            torch.bfloat16: 8 * 2.0 ** -8, torch.float16: 8 * 2.0 ** -11}[dtype]


def _check_steps(device: str, dtype: torch.dtype, backend: str | None) -> list[str]:
    """For every ring layout at N = 2 and 4, runs the block backward of every
    (rank, step) through cplib's own C++ path (ring_sdpa_backward on this
    one-rank group: its single step is exactly one block backward with the
    out and lse it is given) and compares it with the fp64 block gradient.
    Also checks that the fp64 block gradients of the mirrored plan sum to the
    full gradients, so the plan mirror itself is right. Returns failures and
    the report (prefixed "ok ")."""
    group = dist.group.WORLD
    assert dist.get_world_size(group) == 1
    dev = torch.device(device)
    tol = _step_tolerance(dtype)
    lines = []
    for n, (causal, lb) in itertools.product((2, 4), ((True, True), (True, False),
                                                      (False, False))):
        b, hq, hkv, length, d = 1, 4, 2, 64, 32  # length: local rows, two chunks of 32
        s = length * n
        q, k, v, dout = (global_tensor((b, h, s, d), dtype, 7 * n + j)
                         for j, h in enumerate((hq, hkv, hkv, hq)))
        out, lse, dq, dk, dv = reference(q, k, v, dout, is_causal=causal, scale=None)
        local = lambda t, r: shard_seq(t, r, n, lb)  # noqa: E731
        sums = {"dq": [torch.zeros_like(local(dq, r)) for r in range(n)],
                "dk": [torch.zeros_like(local(dk, r)) for r in range(n)],
                "dv": [torch.zeros_like(local(dv, r)) for r in range(n)]}
        for st in _ring_steps(n, causal, lb, length):
            rows = lambda t: t.narrow(2, st.q_start, st.q_len)  # noqa: E731
            kv = lambda t: local(t, st.src).narrow(2, st.kv_start, st.kv_len)  # noqa: E731
            q64, out64, dout64, lse64 = (rows(local(t, st.rank).double())
                                         for t in (q, out, dout, lse))
            want = _block_grads_fp64(q64, kv(k.double()), kv(v.double()), dout64, out64, lse64,
                                     st.causal, d ** -0.5)
            rows(sums["dq"][st.rank]).add_(want[0])
            for name, g in (("dk", want[1]), ("dv", want[2])):
                sums[name][st.src].narrow(2, st.kv_start, st.kv_len).add_(g)
            # The tensors the ring hands the block: views of this rank's
            # contiguous q, out (q's dtype), grad_out and fp32/fp64 lse.
            to_dev = lambda t, dt=dtype: local(t, st.rank).to(dev, dt).contiguous()  # noqa: E731
            acc = torch.float64 if dtype == torch.float64 else torch.float32
            got = ops.ring_sdpa_backward(
                rows(to_dev(dout)), rows(to_dev(q)), kv(k).to(dev), kv(v).to(dev),
                rows(to_dev(out)), rows(to_dev(lse, acc)), group.group_name, st.causal,
                backend=backend or "auto")
            where = (f"{dtype} {backend} n={n} causal={causal} lb={lb} rank {st.rank} step "
                     f"{st.i}: q rows {st.q_start}:{st.q_start + st.q_len} x kv rows "
                     f"{st.kv_start}:{st.kv_start + st.kv_len} of rank {st.src}"
                     f"{' (causal block)' if st.causal else ''}")
            errs = [_rel_err(g, w) for g, w in zip(got, want)]
            ok = all(e <= tol for e in errs)  # NaN fails
            lines.append(("ok " if ok else "") + where + " dq/dk/dv "
                         + " ".join(f"{e:.2e}" for e in errs) + f" (tolerance {tol:.1e})")
        for name, full in (("dq", dq), ("dk", dk), ("dv", dv)):
            for r in range(n):
                torch.testing.assert_close(sums[name][r], local(full, r), atol=1e-10, rtol=1e-10,
                                           msg=f"mirrored plan: {name} of rank {r} n={n} "
                                               f"causal={causal} lb={lb}")
    return lines


def _assert_steps(lines: list[str]) -> None:
    print("\n".join(lines))
    failures = [x for x in lines if not x.startswith("ok ")]
    assert lines and not failures, (f"{len(failures)} of {len(lines)} ring steps' block "
                                    "backward differ from fp64:\n" + "\n".join(failures))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_ring_block_backward_per_step_cpu(threaded, dtype):
    _assert_steps(threaded(1, _check_steps, "cpu", dtype, None)[0])


@needs_cuda
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_ring_block_backward_per_step_cuda(threaded, backend, dtype):
    """Pins a wrong ring gradient (NaN dq from the efficient
    backend, causal and load-balanced) to the step and block that cause it."""
    _assert_steps(threaded(1, _check_steps, "cuda", dtype, backend)[0])
