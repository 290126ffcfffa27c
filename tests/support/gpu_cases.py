"""Shared pieces of the GPU tests (tests/<feature>/test_gpu_*.py): the device,
the ``cuda`` and ``cuda_on_cpu`` marks, fp64 truth with any mask, the single-device run and the
judgement "at most 1.5x the single-device error".

Every GPU test carries the ``cuda`` marker (``benchmarks/gpu/run.sh`` selects them
with ``-m cuda``) and runs several ranks on one GPU through the threaded
process group. Where no GPU is visible they skip, unless
``CPLIB_GPU_TESTS_ON_CPU=1``: then the same bodies run on the CPU (same
dtypes, the CPU kernels), which proves their logic on a machine without a
GPU. What only a GPU reaches is listed in docs/testing.md.

The single-device reference and every process-global switch run in the
main thread; rank threads only call cplib and return their rows (moved to
the CPU), which the main thread places into the global tensors to judge.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness import run_threaded
from ring_mask_cases import visible_at as visible  # noqa: F401  (q/k positions -> mask)

ON_CPU_ENV = "CPLIB_GPU_TESTS_ON_CPU"


def gpu_test_device() -> torch.device | None:
    """cuda:0 where a GPU is visible; the CPU when CPLIB_GPU_TESTS_ON_CPU=1; else None."""
    if torch.cuda.is_available():
        return torch.device("cuda", 0)
    if os.environ.get(ON_CPU_ENV) == "1":
        return torch.device("cpu")
    return None


DEVICE = gpu_test_device()
# Module-level `pytestmark = GPU_MARKS` in every GPU test file. `cuda_on_cpu`
# tells them from the other `cuda` tests, which need a real GPU: `make
# test-gpu-on-cpu` selects them by it.
GPU_MARKS = [pytest.mark.cuda, pytest.mark.cuda_on_cpu,
             pytest.mark.skipif(DEVICE is None, reason=f"needs a CUDA GPU (none visible; "
                                                       f"{ON_CPU_ENV}=1 runs the bodies on CPU)")]
HALF_DTYPES = [torch.bfloat16, torch.float16]
# fp32 rounding of an lse around 5 to 10, which merging adds even where the
# single-device kernel's own lse happens to be exact (as in test_ring_sdpa_threaded).
LSE_SLACK = 1e-5


def sync() -> None:
    if DEVICE is not None and DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def global_input(shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Normal values rounded to ``dtype`` (on the CPU): the fp64 truth then
    starts from exactly the values the device sees."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def square(s: int, **mask) -> torch.Tensor:
    """(S, S) visibility of a whole sequence (``visible``'s keywords)."""
    pos = torch.arange(s)
    return visible(pos, pos, **mask)


def truth(q, k, v, cot, see: torch.Tensor, sinks=None, scale=None) -> dict[str, torch.Tensor]:
    """fp64 out, lse, dq, dk, dv (and dsinks) of attention under ``see``; a
    row that sees no key (and has no sink) has out 0, lse -inf, dq 0."""
    q, k, v = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    s = None if sinks is None else sinks.detach().double().requires_grad_(True)
    g = q.shape[1] // k.shape[1]
    kx, vx = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ kx.transpose(-1, -2) * scale).masked_fill(~see, float("-inf"))
    if s is not None:
        scores = torch.cat([scores, s.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], -1)
    top = scores.amax(-1, keepdim=True).detach()
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    p = torch.exp(scores - top)
    denom = p.sum(-1, keepdim=True)
    lse = (torch.log(denom) + top).squeeze(-1)
    probs = p / torch.where(denom == 0, torch.ones_like(denom), denom)
    out = probs[..., :kx.shape[2]] @ vx
    out.backward(cot.double())
    res = dict(out=out.detach(), lse=lse.detach(), dq=q.grad, dk=k.grad, dv=v.grad)
    if s is not None:
        res["dsinks"] = s.grad
    return res


def _bias(see: torch.Tensor, dtype: torch.dtype, dev: torch.device, b: int, h: int):
    """An additive (B, H, Lq, Lk) bias over 16-aligned rows (the efficient kernel's need)."""
    lq, lk = see.shape
    full = torch.zeros(lq, (lk + 15) // 16 * 16, dtype=dtype, device=dev)
    full[:, :lk].masked_fill_(~see.to(dev), float("-inf"))
    return full[:, :lk].expand(b, h, lq, lk)


def fused_lse(q, k, see, scale) -> torch.Tensor:
    """The log-sum-exp a fused single-device kernel returns under ``see``: the
    efficient kernel with the mask as its bias on CUDA (what SDPA runs for a
    mask there), the CPU flash kernel on the CPU. Rows that see nothing are
    not used."""
    with torch.no_grad():
        pad = -q.shape[-1] % 8  # the kernels want head dims in 16-byte steps; zeros add nothing
        if pad:
            q, k = F.pad(q, (0, pad)), F.pad(k, (0, pad))
        bias = _bias(see, q.dtype, q.device, q.shape[0], q.shape[1])
        if q.device.type == "cuda":
            lse = torch.ops.aten._scaled_dot_product_efficient_attention(
                q, k, k, bias, True, 0.0, False, scale=scale)[1]
            return lse[..., :q.shape[2]].float()
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, k, 0.0, False, attn_mask=bias, scale=scale)[1].float()


def single_device(q, k, v, cot, see: torch.Tensor, sinks=None, scale=None, *,
                  causal_hint: bool | None = None, sink_rows=None) -> dict[str, torch.Tensor]:
    """The same attention in one SDPA call on DEVICE in the inputs' dtype (main
    thread only: SDPA picks its kernel from process-global flags), with
    ``sinks`` applied in fp32 after it. ``causal_hint``: ``see`` is plain
    causal (True) or full (False), so SDPA may take flash or cuDNN. Rows that
    see nothing get the mask of all keys and a zero cotangent (SDPA has no
    answer for them; they add nothing to dk, dv).

    MLA (v's head dim below q/k's): v is zero-padded to q/k's head dim and
    the output sliced, as the ring does at its kernel calls, so both run the
    same kernels. ``sink_rows``: the q rows of each rank, in rank order; the
    sinks' gradient is then one gradient per rank's rows (stacked), each in
    the sinks' dtype, as the ring returns it (every rank's covers its own rows),
    taken from the output as a fused kernel with sinks takes it; the
    gradients of q, k, v go through autograd of the fp32 sink factor."""
    dev = DEVICE
    empty = ~see.any(-1)
    see_ok = see.clone()
    see_ok[empty] = True
    cot = cot.clone()
    cot[:, :, empty] = 0
    qd, kd, vd = (t.to(dev, copy=True).requires_grad_(True) for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    kx, vx = kd.repeat_interleave(g, 1), vd.repeat_interleave(g, 1)
    dv = v.shape[-1]
    if dv < q.shape[-1]:
        vx = F.pad(vx, (0, q.shape[-1] - dv))
    sc = q.shape[-1] ** -0.5 if scale is None else scale
    if causal_hint is None:
        out = F.scaled_dot_product_attention(qd, kx, vx, attn_mask=see_ok.to(dev), scale=scale)
    else:
        out = F.scaled_dot_product_attention(qd, kx, vx, is_causal=causal_hint, scale=scale)
    out = out[..., :dv]
    lse = fused_lse(qd.detach(), kx.detach(), see_ok, sc)
    res: dict[str, Any] = {}
    sd = None
    if sinks is not None:
        # lse in fp32 from the dtype's scores, differentiable: out * exp(lse - lse')
        sd = sinks.to(dev, copy=True).requires_grad_(True)
        scores = (qd.float() @ kx.float().transpose(-1, -2) * sc).masked_fill(
            ~see_ok.to(dev), float("-inf"))
        lse32 = torch.logsumexp(scores, -1)
        lse_all = torch.logaddexp(lse32, sd.float().view(1, -1, 1))
        out = (out.float() * torch.exp(lse32 - lse_all).unsqueeze(-1)).to(q.dtype)
        lse = torch.logaddexp(lse, sd.detach().float().view(1, -1, 1))
    if sd is not None:
        # As a fused kernel with sinks computes it: from its output in the
        # dtype (FlashAttention's backward takes rowsum(dO * O) so).
        delta = (cot.to(dev).float() * out.detach().float()).sum(-1)
        per_row = -(delta * torch.exp(sd.detach().float().view(1, -1, 1) - lse)).cpu()
        parts = [torch.arange(q.shape[2])] if sink_rows is None else sink_rows
        res["dsinks"] = torch.stack([per_row[:, :, rows].sum((0, 2)).to(sinks.dtype).double()
                                     for rows in parts])
    out.backward(cot.to(dev))
    sync()
    res.update(out=out.detach().cpu(), lse=lse.cpu(), dq=qd.grad.cpu(), dk=kd.grad.cpu(),
               dv=vd.grad.cpu())
    return res


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """sqrt(sum |got - want|^2 / sum |want|^2) in fp64; NaN stays NaN."""
    got, want = got.detach().double().cpu(), want.double().cpu()
    den = want.pow(2).sum()
    return ((got - want).pow(2).sum() / (den if den > 0 else 1.0)).sqrt().item()


@dataclass
class Case:
    """One attention problem over global rows: inputs (in the dtype, CPU),
    the mask, the fp64 truth and the single-device result."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cot: torch.Tensor
    see: torch.Tensor
    sinks: torch.Tensor | None = None
    scale: float | None = None
    what: str = ""
    want: dict = field(default_factory=dict)
    single: dict = field(default_factory=dict)


def make_case(b, hq, hkv, lq, lk, d, dtype, seed, see, *, dv=None, sinks=False, scale=None,
              what="", causal_hint=None, grads=True, sink_rows=None) -> Case:
    """Inputs, fp64 truth and the single-device result (main thread).
    ``sinks``: True draws N(0, 1) logits in ``dtype``; a tensor gives them."""
    dv = d if dv is None else dv
    q = global_input((b, hq, lq, d), dtype, seed)
    k = global_input((b, hkv, lk, d), dtype, seed + 1)
    v = global_input((b, hkv, lk, dv), dtype, seed + 2)
    cot = global_input((b, hq, lq, dv), dtype, seed + 3) if grads else torch.zeros(
        b, hq, lq, dv, dtype=dtype)
    snk = sinks if isinstance(sinks, torch.Tensor) else (
        global_input((hq,), dtype, seed + 4) if sinks else None)
    c = Case(q, k, v, cot, see, snk, scale, what)
    c.want = truth(q, k, v, cot, see, snk, scale)
    if snk is not None:  # per rank, as the ring returns it: -rowsum(dO O) exp(s - lse), its rows
        per_row = -((cot.double() * c.want["out"]).sum(-1)
                    * torch.exp(snk.double().view(1, -1, 1) - c.want["lse"]))
        parts = [torch.arange(lq)] if sink_rows is None else sink_rows
        c.want["dsinks"] = torch.stack([per_row[:, :, r].sum((0, 2)) for r in parts])
    c.single = single_device(q, k, v, cot, see, snk, scale, causal_hint=causal_hint,
                             sink_rows=sink_rows)
    return c


def judge(case: Case, got: dict[str, torch.Tensor], names=("out", "lse", "dq", "dk", "dv"),
          what: str = "") -> list[str]:
    """Failures of ``got`` (global tensors) against the fp64 truth: each error
    at most 1.5x the single-device one (lse: its max abs error, plus
    LSE_SLACK); rows that see nothing (and have no sink) exactly out 0,
    lse -inf, dq 0. NaN fails. Returns the failing lines (empty: passed)."""
    live = case.see.any(-1) if case.sinks is None else torch.ones(case.see.shape[0], dtype=bool)
    failures, label = [], f"{case.what} {what}".strip()
    for name in names:
        g, w, s = got[name], case.want[name], case.single.get(name)
        if name in ("out", "dq", "lse"):
            g_l, w_l, s_l = (t[:, :, live] for t in (g, w, s))
        else:
            g_l, w_l, s_l = g, w, s
        if name == "lse":
            err = (g_l.double() - w_l).abs().max().item() if g_l.numel() else 0.0
            ref = (s_l.double() - w_l).abs().max().item() if s_l.numel() else 0.0
            bound = 1.5 * ref + LSE_SLACK
        else:
            err, ref = rel_err(g_l, w_l), rel_err(s_l, w_l)
            bound = 1.5 * ref
        if not err <= bound:  # NaN fails
            failures.append(f"{label} {name}: error {err:.3e} > 1.5 x single-device {ref:.3e}")
    dead = ~live
    if dead.any():
        if "out" in names and not bool((got["out"][:, :, dead] == 0).all()):
            failures.append(f"{label}: a row that sees no key has out != 0")
        if "lse" in names and not bool(torch.isneginf(got["lse"][:, :, dead]).all()):
            failures.append(f"{label}: a row that sees no key has lse != -inf")
        if "dq" in names and not bool((got["dq"][:, :, dead] == 0).all()):
            failures.append(f"{label}: a row that sees no key has dq != 0")
    return failures


def place(per_rank: list[dict], shapes: dict[str, tuple], rows: dict[str, str]) -> dict:
    """Global tensors from the ranks' rows: ``rows`` maps a result name to the
    index name ("qpos" or "kvpos") of the rows it holds; "dsinks" is stacked
    in rank order (make_case's ``sink_rows`` must be in rank order too)."""
    out = {}
    for name, shape in shapes.items():
        if name == "dsinks":  # each rank's gradient covers its own rows
            out[name] = torch.stack([r[name].double() for r in per_rank])
            continue
        dt = torch.float64
        t = torch.full(shape, float("nan"), dtype=dt)
        for r in per_rank:
            t[:, :, r[rows[name]]] = r[name].double()
        out[name] = t
    return out


def ranks(n: int, body: Callable[..., dict], *args: Any) -> list[dict]:
    """``body(*args)`` on ``n`` threaded ranks sharing DEVICE."""
    return run_threaded(n, body, *args)


def assert_ok(failures: list[str], count: int) -> None:
    assert count > 0, "no case ran"
    assert not failures, f"{len(failures)} checks failed:\n" + "\n".join(failures)


def local_rows(t: torch.Tensor, rows: torch.Tensor, grad: bool) -> torch.Tensor:
    """This rank's rows of a global tensor, on DEVICE (a leaf when ``grad``)."""
    return t.detach()[:, :, rows].to(DEVICE).requires_grad_(grad)


def world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()
