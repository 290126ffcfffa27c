"""The ring's masked CUDA tiles with real masks (GPU; CPLIB_GPU_TESTS_ON_CPU=1
runs the same bodies on the CPU): sliding windows (causal and two-sided),
packed documents (and their per-document layout), explicit q/k positions,
any length with tiles whose key count is not a multiple of 16 (the bias
padding) and query counts not a multiple of 32 (the masked backward's lse
padding), and rows that see no key at all (out 0, lse -inf, dq 0). bf16 and
fp16 on 2 and 4 threaded ranks sharing one GPU, every result against fp64
truth: at most 1.5x the error of one single-device SDPA call with the same
mask (tests/support/gpu_cases.py)."""

from __future__ import annotations

import pytest
import torch

from gpu_cases import DEVICE, GPU_MARKS, HALF_DTYPES, assert_ok, make_case, square, visible
from gpu_ring_cases import head_tail, run_ring

pytestmark = GPU_MARKS


def _backend(name):
    # The CPU has one kernel; a named CUDA backend runs the tiles without a mask.
    return name if DEVICE is not None and DEVICE.type == "cuda" else None



@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=["bf16", "fp16"])
def test_ring_windows_documents_any_length(world_size, dtype):
    n, failures, count = world_size, [], 0
    d, hq, hkv = 64, 4, 2
    s = 32 * n
    cases = [
        # causal sliding window, head-tail shards, p2p
        (dict(causal=True, window=(20, 0)), dict(is_causal=True, window=(20, 0),
                                                 load_balanced=True, backend=None), s, True),
        # two-sided window, sequential shards, all-to-all, flash for the full tiles
        (dict(causal=False, window=(9, 5)), dict(window=(9, 5), rotate="alltoall",
                                                 backend=_backend("flash")), s, False),
        # packed documents (one of length 1), causal, all-gather
        (dict(causal=True, cu_seqlens=[0, 17, 40, 41, s]),
         dict(is_causal=True, cu_seqlens=torch.tensor([0, 17, 40, 41, s]), rotate="allgather",
              load_balanced=True, backend=None), s, True),
        # any length: S = 16n + 5 (local tiles of 9 to 19 rows, no multiple of 16),
        # documents and a window together, head-tail, cuDNN for the full tiles
        (dict(causal=True, window=(11, 0), cu_seqlens=[0, 23, 16 * n + 5]),
         dict(is_causal=True, window=(11, 0), cu_seqlens=torch.tensor([0, 23, 16 * n + 5]),
              seq_len=16 * n + 5, load_balanced=True, backend=_backend("cudnn")),
         16 * n + 5, True),
    ]
    for i, (mask, kw, length, lb) in enumerate(cases):
        see = square(length, **mask)
        case = make_case(1, hq, hkv, length, length, d, dtype, 100 * i, see,
                         what=f"{dtype} {mask}")
        failures += run_ring(case, n, head_tail(length, lb), **kw)
        count += 1
    # per-document head-tail layout of an uneven sequence
    docs = [0, 13, 13 + 8 * n + 3, 13 + 8 * n + 3 + 9]
    length = docs[-1]
    see = square(length, causal=True, cu_seqlens=docs)
    case = make_case(2, hq, hkv, length, length, d, dtype, 900, see, what=f"{dtype} per-document")
    failures += run_ring(case, n, head_tail(length, True, documents=docs), is_causal=True,
                         cu_seqlens=torch.tensor(docs), seq_len=length, per_document=True,
                         load_balanced=True)
    assert_ok(failures, count + 1)


def chunks(lq: int, lk: int):
    """q and kv rows dealt in contiguous chunks over the ranks (any sizes)."""
    def layout(rank, n):
        return torch.arange(lq).tensor_split(n)[rank], torch.arange(lk).tensor_split(n)[rank]
    return layout


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=["bf16", "fp16"])
def test_ring_positions_and_rows_that_see_nothing(world_size, dtype):
    """Explicit positions: every key but the first of each document is held,
    so the first query of each document sees no key (out 0, lse -inf, dq 0);
    keys in shuffled order; a window on top. Gradients flow through the
    masked backward on tiles of 9 to 21 rows."""
    n, failures = world_size, []
    s = 20 * n + 3
    docs = [0, 7, 7 + 10 * n, s]
    q_rows = torch.arange(s)
    kept = torch.tensor([p for p in range(s) if p not in docs[:-1]])
    kv_rows = kept[torch.randperm(kept.numel(), generator=torch.Generator().manual_seed(5))]
    for i, window in enumerate((None, (6, 0))):
        see = visible(q_rows, kv_rows, causal=True, window=window, cu_seqlens=docs)
        assert (~see.any(-1)).sum() == 3  # the documents' first queries
        case = make_case(1, 4, 1, s, kv_rows.numel(), 64, dtype, 50 + i, see,
                         what=f"{dtype} positions window={window}")
        failures += run_ring(case, n, chunks(s, kv_rows.numel()), positions=(q_rows, kv_rows),
                             is_causal=True, window=window, cu_seqlens=torch.tensor(docs))
    assert_ok(failures, 2)
