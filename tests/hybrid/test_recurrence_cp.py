"""The recurrences of hybrid layers under context parallelism, against the
same kernel over the whole sequence in one process (transformers' torch
kernels, fp32): Gated DeltaNet (GQA-style: 2 key heads, 4 value heads) and
Kimi Delta Attention (per-channel gates) by state passing and by head
re-sharding, Mamba2's SSD by state passing; outputs and the gradients of
every input, sequential (uneven) and head-tail shards, 1, 2 and 4 ranks.
State passing moves the same bytes per rank at every sequence length."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from cplib.hybrid.delta_rule import delta_rule_by_heads, delta_rule_by_state
from cplib.attention.names import Layout
from cplib.hybrid.layout import SequenceLayout
from cplib.hybrid.ssd import ssd_by_state
from harness import assert_close

WORLD_SIZES = [1, 2, 4]
TOL = dict(atol=2e-5, rtol=2e-5)


def _layout(s: int, head_tail: bool) -> SequenceLayout:
    return SequenceLayout(dist.group.WORLD.group_name, dist.get_world_size(), dist.get_rank(),
                          s, Layout.HEAD_TAIL if head_tail else Layout.SEQUENTIAL)


def _local(layout: SequenceLayout, full: torch.Tensor) -> torch.Tensor:
    return torch.cat([full[:, start:start + n] for start, n in layout.pieces()], 1)


def _delta_inputs(s: int, kda: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(s + kda)
    b, hk, hv, d = 2, 2, 4, 8
    q, k = (torch.randn(b, s, hk if not kda else hv, d, generator=g) for _ in range(2))
    v = torch.randn(b, s, hv, d, generator=g)
    gate = -F.softplus(torch.randn(b, s, hv, *((d,) if kda else ()), generator=g))
    beta = torch.rand(b, s, hv, generator=g)
    return [q, k, v, gate, beta]


def _kernel(kda: bool):
    if kda:
        from transformers.models.kimi_linear import modeling_kimi_linear as m
        return m.chunk_kimi_delta_attention
    from transformers.models.qwen3_next import modeling_qwen3_next as m
    return m.torch_chunk_gated_delta_rule


def _compare(layout, got, want, leaves, refs, cot, what) -> None:
    (got * _local(layout, cot)).sum().backward()
    (want * cot).sum().backward()
    assert_close(got, _local(layout, want.detach()), what=f"{what}: out", **TOL)
    for i, (mine, ref) in enumerate(zip(leaves, refs)):
        grad = ref.grad if ref.grad.dim() > 1 and ref.grad.shape[1] == want.shape[1] else None
        if grad is None:  # a parameter (A): each rank holds its share
            summed = mine.grad.clone()
            dist.all_reduce(summed)
            assert_close(summed, ref.grad, what=f"{what}: grad {i} (summed)", **TOL)
        else:
            assert_close(mine.grad, _local(layout, grad), what=f"{what}: grad {i}", **TOL)


def _check_delta(s: int, head_tail: bool, way: str, kda: bool) -> int:
    layout = _layout(s, head_tail)
    kernel, kw = _kernel(kda), {"use_qk_l2norm_in_kernel": True, "chunk_size": 8}
    full = _delta_inputs(s, kda)
    refs = [t.clone().requires_grad_() for t in full]
    want, _ = kernel(*refs[:3], g=refs[3], beta=refs[4], **kw)
    leaves = [_local(layout, t).requires_grad_() for t in full]
    if way == "heads":
        got = delta_rule_by_heads(kernel, layout, *leaves, kw)
    else:
        got, _ = delta_rule_by_state(kernel, layout, *leaves, False, kw)
    cot = torch.randn(want.shape, generator=torch.Generator().manual_seed(7))
    what = f"{'KDA' if kda else 'GDN'} S={s} head_tail={head_tail} {way} n={layout.world_size}"
    _compare(layout, got, want, leaves, refs, cot, what)
    return 1


def _ssd_inputs(s: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(s)
    b, h, p, groups, n = 2, 4, 8, 2, 8
    x = torch.randn(b, s, h, p, generator=g)
    dt = torch.randn(b, s, h, generator=g)
    a = -torch.rand(h, generator=g) - 0.5
    bb, cc = (torch.randn(b, s, groups, n, generator=g) for _ in range(2))
    return [x, dt, a, bb, cc]


def _check_ssd(s: int, head_tail: bool) -> int:
    from transformers.models.falcon_h1 import modeling_falcon_h1 as m

    layout = _layout(s, head_tail)
    h = 4
    kw = {"D": torch.ones(h), "dt_bias": torch.full((h,), 0.5), "dt_softplus": True,
          "dt_limit": (0.0, float("inf"))}
    full = _ssd_inputs(s)
    refs = [t.clone().requires_grad_() for t in full]
    want = m.mamba2_chunk_scan(*refs, 8, **kw)
    leaves = [t.clone().requires_grad_() if i == 2 else _local(layout, t).requires_grad_()
              for i, t in enumerate(full)]
    got, _ = ssd_by_state(m.mamba2_chunk_scan, layout, *leaves, 8, dict(kw))
    cot = torch.randn(want.shape, generator=torch.Generator().manual_seed(8))
    _compare(layout, got, want, leaves, refs, cot,
             f"SSD S={s} head_tail={head_tail} n={layout.world_size}")
    return 1


def _check_all() -> int:
    n = dist.get_world_size()
    count = 0
    for head_tail in (False, True):
        s = 12 * n + (0 if head_tail else 3)
        for kda in (False, True):
            for way in ("state", "heads") if 2 % n == 0 or n == 1 else ("state",):
                count += _check_delta(s, head_tail, way, kda)
        count += _check_ssd(s, head_tail)
    return count


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_recurrences_match_the_whole_sequence(ranks, world_size):
    expected = {1: 10, 2: 10, 4: 6}[world_size]
    assert ranks(world_size).run(_check_all) == [expected] * world_size


class _GatherBytes(TorchDispatchMode):
    """Bytes each state exchange (flex_cp_allgather) sends from this rank."""

    def __init__(self):
        super().__init__()
        self.sent: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.cplib_c.flex_cp_allgather.default:
            self.sent.append(sum(t.numel() * t.element_size() for t in args[:2]))
        return func(*args, **(kwargs or {}))


def _state_bytes(s: int) -> list[int]:
    layout = _layout(s, True)
    kernel = _kernel(False)
    leaves = [_local(layout, t) for t in _delta_inputs(s, False)]
    with _GatherBytes() as counter:
        delta_rule_by_state(kernel, layout, *leaves, False, {"chunk_size": 8})
    return counter.sent


def _check_bytes() -> list[list[int]]:
    return [_state_bytes(s) for s in (16 * dist.get_world_size(), 128 * dist.get_world_size())]


@pytest.mark.parametrize("world_size", [2, 4])
def test_state_passing_bytes_do_not_grow_with_the_sequence(ranks, world_size):
    # One exchange per call: per rank, 2 head-tail pieces x B=2 x 4 value heads
    # x d_k=8 x (d_k + d_v = 16) float32 values (the final state and the transition).
    want = 2 * 2 * 4 * 8 * 16 * 4
    assert ranks(world_size).run(_check_bytes) == [[[want], [want]]] * world_size


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _low_precision_errors(layout, run, full, low, cot) -> dict[str, tuple[float, float]]:
    """Per output and input gradient: (error under CP, error of one process in
    ``low`` precision), both against the float64 run of the same kernel."""
    def one(inputs, sharded: bool):
        leaves = [(_local(layout, t) if sharded and t.dim() > 1 else t).requires_grad_()
                  for t in inputs]
        out = run(leaves, sharded)
        (out.double() * (_local(layout, cot) if sharded else cot)).sum().backward()
        return [out] + [x.grad for x in leaves]

    truth = one([t.double() for t in full], False)
    single, cp = one([t.clone() for t in low], False), one([t.clone() for t in low], True)
    errors = {}
    for i, (t, s, c) in enumerate(zip(truth, single, cp)):
        if t.dim() > 1:  # the output and the per-token inputs' gradients
            errors[f"#{i}"] = (_rel(c, _local(layout, t)),
                               _rel(_local(layout, s), _local(layout, t)))
    return errors


def _check_low_precision(dtype_name: str) -> int:
    dtype = getattr(torch, dtype_name)
    n = dist.get_world_size()
    count = 0
    for head_tail in (False, True):
        layout = _layout(32 * n, head_tail)
        for kda in (False, True):
            kernel, kw = _kernel(kda), {"use_qk_l2norm_in_kernel": True, "chunk_size": 16}
            full = _delta_inputs(layout.seq_len, kda)
            for way in ("state", "heads") if n == 2 else ("state",):
                def run(x, sharded, way=way):
                    if not sharded:
                        return kernel(*x[:3], g=x[3], beta=x[4], **kw)[0]
                    if way == "heads":
                        return delta_rule_by_heads(kernel, layout, *x, kw)
                    return delta_rule_by_state(kernel, layout, *x, False, kw)[0]
                cot = torch.randn(2, layout.seq_len, 4, 8, dtype=torch.float64,
                                  generator=torch.Generator().manual_seed(3))
                errors = _low_precision_errors(layout, run, full, [t.to(dtype) for t in full],
                                               cot)
                for what, (cp, single) in errors.items():
                    assert cp <= 1.5 * single, (kda, head_tail, way, dtype_name, what, cp, single)
                count += 1
    return count


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_within_one_and_a_half_single_device_error(ranks, world_size, dtype):
    assert ranks(world_size).run(_check_low_precision, dtype) == \
        [8 if world_size == 2 else 4] * world_size
