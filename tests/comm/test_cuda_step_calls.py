"""On the CUDA route a ring step costs at most one Python round trip for its
attention: cuDNN's forward is reached through a Python op (the stable
dispatcher cannot return its SymInts, docs/ring.md), and a step whose calls
run cuDNN makes one call of ``cplib_c::_cudnn_attention_step`` for all of
them (documents and windows make several calls a step); flash and the
memory-efficient kernel, and every backward, are called from C++.

Checked on META tensors through ``cplib_c::_cuda_ring_forward_probe``: the
ring's own forward (csrc/torch/ring/ring_forward.cpp) on a ring of one rank,
taking the CUDA kernels, with the layouts, documents and windows the ring
takes; torch.profiler counts the Python-level ops and the ATen kernels."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import cplib  # noqa: F401  (loads the ops)
from cplib.comm.native import ops

PYTHON_OPS = ("cplib_c::_cudnn_attention", "cplib_c::_cudnn_attention_step")


def _plan_calls(seq: int, causal: bool, layout: str, cu_seqlens, window) -> list[int]:
    """The kinds (1 full, 2 causal, 3 partial) of the one step's calls, from the
    ring's planner."""
    flat = list(ops.ring_plan_summary(seq, 1, causal, layout, cu_seqlens, window, "p2p"))
    assert flat[:3] == [1, seq, 1], flat  # one rank, one step
    count = flat[8]
    return [flat[9 + 3 * i] for i in range(count)]


def _run(backend: str, layout: str, cu_seqlens=None, window=None, heads=(4, 2), dv=64):
    seq = 96
    meta = dict(device="meta", dtype=torch.bfloat16)
    q = torch.empty(1, heads[0], seq, 64, **meta)
    k = torch.empty(1, heads[1], seq, 64, **meta)
    v = torch.empty(1, heads[1], seq, dv, **meta)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out, lse = ops._cuda_ring_forward_probe(q, k, v, backend, True, cu_seqlens, window,
                                               layout=layout)
    assert out.shape == (1, heads[0], seq, dv) and lse.shape == (1, heads[0], seq)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    names = Counter(e.name for e in prof.events())
    return {n: names[n] for n in names if n in PYTHON_OPS or "attention" in n}, \
        _plan_calls(seq, True, layout, cu_seqlens, window)


@pytest.mark.parametrize("layout,docs,window", [
    ("per_document", [0, 40, 41, 96], None),   # three causal calls in the step
    ("placement", [0, 40, 41, 96], None),
    ("per_document", [0, 30, 60, 96], [16, 0]),  # causal calls beside masked tiles
])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_a_steps_cudnn_calls_take_one_python_round_trip(layout, docs, window, heads):
    seen, kinds = _run("cudnn", layout, docs, window, heads)
    plain = sum(k in (1, 2) for k in kinds)
    assert plain >= 3, kinds  # the case makes several cuDNN calls in one step
    assert seen.get("cplib_c::_cudnn_attention_step") == 1, seen
    assert "cplib_c::_cudnn_attention" not in seen, seen
    assert seen.get("aten::_scaled_dot_product_cudnn_attention") == plain, seen
    # masked tiles run the memory-efficient kernel, from C++
    assert seen.get("aten::_scaled_dot_product_efficient_attention", 0) == \
        sum(k == 3 for k in kinds), seen


def test_a_dense_step_makes_one_call_and_other_kernels_none():
    seen, kinds = _run("cudnn", "sequential")
    assert kinds == [2] and seen.get("cplib_c::_cudnn_attention") == 1, (kinds, seen)
    assert "cplib_c::_cudnn_attention_step" not in seen, seen
    for backend in ("flash", "efficient"):
        seen, _ = _run(backend, "per_document", [0, 40, 41, 96])
        assert not any(n in seen for n in PYTHON_OPS), (backend, seen)


def test_mla_blocks_are_padded_and_batched_alike():
    """v's head dim below q's: cuDNN gets zero-padded blocks (block.cpp), the
    step's blocks still in one Python round trip."""
    seen, kinds = _run("cudnn", "per_document", [0, 40, 41, 96], dv=32)
    assert seen.get("cplib_c::_cudnn_attention_step") == 1, seen
    assert seen.get("aten::_scaled_dot_product_cudnn_attention") == \
        sum(k in (1, 2) for k in kinds), seen
