"""Ulysses and USP on CUDA tensors (GPU; CPLIB_GPU_TESTS_ON_CPU=1 runs the
same bodies on the CPU): ``ulysses_sdpa`` on 2 and 4 threaded ranks sharing
one GPU (causal GQA, non-causal MLA, a window with documents) and
``usp_sdpa`` on 4 ranks as 2 Ulysses x 2 ring (load-balanced causal and
non-causal), bf16 and fp16, against fp64 truth: at most 1.5x the error of
one single-device SDPA call (tests/support/gpu_cases.py). The USP subgroups are made
in the rank threads with ``dist.new_group``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import cplib
from cplib.attention.layout import shard_positions
from cplib.ulysses.usp_layout import usp_shard_ranges
from gpu_cases import (GPU_MARKS, HALF_DTYPES, Case, assert_ok, judge, local_rows, make_case,
                       place, ranks, square, sync)

pytestmark = GPU_MARKS
ROWS = dict(out="qpos", lse="qpos", dq="qpos", dk="kvpos", dv="kvpos")



def _rank(case: Case, layout, usp_degree: int, kw: dict) -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    rows = layout(rank, n)
    ql, kl, vl = (local_rows(t, rows, True) for t in (case.q, case.k, case.v))
    if usp_degree:
        u = usp_degree
        made = {}  # every rank makes every subgroup, in one order
        for members in ([[i * u + j for j in range(u)] for i in range(n // u)]
                        + [[i * u + j for i in range(n // u)] for j in range(u)]):
            made[tuple(members)] = dist.new_group(members)
        ug = made[tuple(range(rank // u * u, rank // u * u + u))]
        rg = made[tuple(range(rank % u, n, u))]
        out, lse = cplib.usp_sdpa(ql, kl, vl, ug, rg, **kw)
    else:
        out, lse = cplib.ulysses_sdpa(ql, kl, vl, dist.group.WORLD, **kw)
    out.backward(local_rows(case.cot, rows, False))
    sync()
    return dict(qpos=rows, kvpos=rows, out=out.detach().cpu(), lse=lse.detach().cpu(),
                dq=ql.grad.cpu(), dk=kl.grad.cpu(), dv=vl.grad.cpu())


def _run(case: Case, n: int, layout, usp_degree: int = 0, **kw) -> list[str]:
    per_rank = ranks(n, _rank, case, layout, usp_degree, kw)
    names = ("out", "lse", "dq", "dk", "dv")
    got = place(per_rank, {k: case.want[k].shape for k in names}, ROWS)
    return judge(case, got, names, what=f"n={n} usp_degree={usp_degree} {kw}")


def _sequential(s):
    return lambda rank, n: shard_positions(s, n, rank, False)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=["bf16", "fp16"])
def test_ulysses_on_gpu(world_size, dtype):
    n, s, failures = world_size, 32 * world_size, []
    cases = [  # (hkv, v head dim, mask, keywords)
        (2, 64, dict(causal=True), dict(is_causal=True)),
        (4, 32, dict(causal=False), dict()),
        (1, 64, dict(causal=True, window=(9, 0), cu_seqlens=[0, 21, s]),
         dict(is_causal=True, window=(9, 0), cu_seqlens=torch.tensor([0, 21, s]))),
    ]
    for i, (hkv, dv, mask, kw) in enumerate(cases):
        plain = set(mask) == {"causal"}
        case = make_case(1, 4, hkv, s, s, 64, dtype, 200 + i, square(s, **mask), dv=dv,
                         causal_hint=mask["causal"] if plain else None,
                         what=f"{dtype} ulysses hkv={hkv} dv={dv} {mask}")
        failures += _run(case, n, _sequential(s), **kw)
    assert_ok(failures, len(cases))


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=["bf16", "fp16"])
def test_usp_on_gpu(dtype):
    n, u, s, failures = 4, 2, 128, []

    def layout_of(lb):
        def layout(rank, world):
            parts = [torch.arange(a, a + m) for a, m in usp_shard_ranges(s, world, u, rank, lb)]
            return torch.cat(parts)
        return layout
    for i, (causal, lb, rotate) in enumerate(((True, True, "p2p"), (False, False, "alltoall"))):
        case = make_case(1, 4, 2, s, s, 64, dtype, 300 + i, square(s, causal=causal),
                         causal_hint=causal, what=f"{dtype} usp 2x2 causal={causal}")
        failures += _run(case, n, layout_of(lb), u, is_causal=causal, load_balanced=lb,
                         rotate=rotate)
    assert_ok(failures, 2)
