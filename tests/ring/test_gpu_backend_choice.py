"""The automatic backend choice (``backend=None``) of ring_sdpa on CUDA
tensors (GPU; CPLIB_GPU_TESTS_ON_CPU=1 runs the same bodies on the CPU,
whose one kernel makes no choice): for each dtype (bf16, fp16, fp32), head
dim (36, which flash takes only padded to a multiple of 8; 64; 128) and mask
kind (none, causal, window, documents, explicit positions), the ring on 2
threaded ranks sharing one GPU against fp64 truth: at most 1.5x the error of
one single-device SDPA call with the same mask (tests/support/gpu_cases.py)."""

from __future__ import annotations

import pytest
import torch

from gpu_cases import GPU_MARKS, assert_ok, make_case, visible
from gpu_ring_cases import head_tail, run_ring

pytestmark = GPU_MARKS
S = 96  # local tiles of 48 rows (head-tail chunks of 24)
DOCS = [0, 29, 30, S]
MASKS = {  # mask kind: (visibility, ring keywords, load balanced, positions)
    "none": (dict(causal=False), dict(), False),
    "causal": (dict(causal=True), dict(is_causal=True, load_balanced=True), True),
    "window": (dict(causal=True, window=(19, 0)),
               dict(is_causal=True, window=(19, 0), load_balanced=True), True),
    "documents": (dict(causal=True, cu_seqlens=DOCS),
                  dict(is_causal=True, cu_seqlens=torch.tensor(DOCS)), False),
    "positions": (dict(causal=True), dict(is_causal=True), None),
}


def _interleaved(rank, n):
    rows = torch.arange(rank, S, n)  # round-robin rows, as a decode cache holds them
    return rows, rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("head_dim", [36, 64, 128])
def test_auto_backend_per_dtype_head_dim_and_mask(dtype, head_dim):
    failures = []
    for i, (kind, (mask, kw, lb)) in enumerate(MASKS.items()):
        pos = torch.arange(S)
        plain = set(mask) == {"causal"} and kind != "positions"
        case = make_case(1, 4, 2, S, S, head_dim, dtype, 500 + i, visible(pos, pos, **mask),
                         causal_hint=mask["causal"] if plain else None,
                         what=f"{dtype} d={head_dim} {kind}")
        if lb is None:
            failures += run_ring(case, 2, _interleaved, positions=(pos, pos), backend=None, **kw)
        else:
            failures += run_ring(case, 2, head_tail(S, lb), backend=None, **kw)
    assert_ok(failures, len(MASKS))
