"""Which ATen kernel each CUDA block runs, on machines without a GPU.

cuDNN's frontend refuses the backward of a block with one query row and one
key ("cuDNN Frontend error: s_q = s_kv = 1 is not supported.", seen on an H200
with torch 2.11.0+cu130 in the ring's windows/documents test with ragged
lengths); its forward serves that block, and blocks with only one of the two
lengths 1 run both ways. cplib runs that backward, and only it, on the
memory-efficient kernel (csrc/torch/attention/block_cuda.cpp:
cudnn_refuses_backward). ``cplib_c::_cuda_glue_probe`` runs one block along the
ring's route on META tensors; torch.profiler records the ATen kernels it calls.
"""

from __future__ import annotations

import pytest
import torch

import cplib  # noqa: F401  (registers the ops)
from cplib.comm.native import ops

FORWARD = {"aten::_scaled_dot_product_cudnn_attention": "cudnn",
           "aten::_scaled_dot_product_efficient_attention": "efficient",
           "aten::_flash_attention_forward": "flash"}
BACKWARD = {"aten::_scaled_dot_product_cudnn_attention_backward": "cudnn",
            "aten::_scaled_dot_product_efficient_attention_backward": "efficient",
            "aten::_scaled_dot_product_flash_attention_backward": "flash"}


def _kernels(backend: str, lq: int, lk: int, causal: bool, v_dim: int = 64):
    """(forward kernels, backward kernels, results) of one probed block."""
    q = torch.empty(2, 4, lq, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(2, 2, lk, 64, device="meta", dtype=torch.bfloat16)
    v = torch.empty(2, 2, lk, v_dim, device="meta", dtype=torch.bfloat16)
    with torch.profiler.profile() as prof:
        results = ops._cuda_glue_probe(q, k, v, backend, causal, False, True, 0.125)
    names = [e.name for e in prof.events()]
    return ([FORWARD[n] for n in names if n in FORWARD],
            [BACKWARD[n] for n in names if n in BACKWARD], (q, k, v), results)


# (q rows, k/v rows, causal): the probe runs a non-causal backward in two row
# halves (as load-balanced ring steps do), so 2 rows against 1 key gives two
# 1x1 backward blocks.
ONE_BY_ONE = [(1, 1, False), (1, 1, True), (2, 1, False)]


@pytest.mark.parametrize("v_dim", [64, 32], ids=["mha", "mla"])
@pytest.mark.parametrize("lq,lk,causal", ONE_BY_ONE,
                         ids=[f"q{a}k{b}" + ("-causal" if c else "") for a, b, c in ONE_BY_ONE])
def test_cudnn_hands_one_by_one_backward_blocks_to_efficient(lq, lk, causal, v_dim):
    forward, backward, (q, k, v), (out, lse, dq, dk, dv) = _kernels("cudnn", lq, lk, causal, v_dim)
    assert forward == ["cudnn"], forward
    assert backward == ["efficient"] * (1 if causal else lq), backward
    assert out.shape == (2, 4, lq, v_dim) and lse.shape == (2, 4, lq)
    for grad, like in ((dq, q), (dk, k), (dv, v)):
        assert (grad.shape, grad.dtype) == (like.shape, like.dtype)


# Blocks cuDNN serves both ways, including those with one length 1.
SERVED = [(1, 64, False), (64, 1, True), (2, 2, True), (96, 160, False)]


@pytest.mark.parametrize("lq,lk,causal", SERVED,
                         ids=[f"q{a}k{b}" + ("-causal" if c else "") for a, b, c in SERVED])
def test_cudnn_keeps_every_other_block(lq, lk, causal):
    forward, backward, _, _ = _kernels("cudnn", lq, lk, causal)
    halves = 1 if causal or lq < 2 else 2
    assert (forward, backward) == (["cudnn"], ["cudnn"] * halves), (forward, backward)


@pytest.mark.parametrize("backend", ["flash", "efficient"])
def test_other_backends_keep_their_kernel_for_one_by_one_blocks(backend):
    forward, backward, _, _ = _kernels(backend, 1, 1, False)
    assert (forward, backward) == ([backend], [backend]), (forward, backward)


PROFILED = {torch.bfloat16: "c10::BFloat16", torch.float16: "c10::Half", torch.float32: "float"}


def _efficient_inputs(head_dim: int, dtype: torch.dtype, masked: bool,
                      in_masked_call: bool = False, backend: str = "efficient"):
    """The (head dim, dtype) pairs of q, k, v (and grad_out) that the
    efficient kernels received, forward and backward, for one probed causal
    block of ``head_dim`` in ``dtype`` (``masked``: a block with a mask;
    ``in_masked_call``: of a call with documents, a window or positions), and
    the probe's results."""
    q = torch.empty(1, 4, 48, head_dim, device="meta", dtype=dtype)
    k = torch.empty(1, 2, 48, head_dim, device="meta", dtype=dtype)
    with torch.profiler.profile(record_shapes=True) as prof:
        results = ops._cuda_glue_probe(q, k, k, backend, True, masked, True, None, in_masked_call)
    seen = {}
    # The kineto events: torch 2.11's FunctionEvent has no input dtypes.
    for e in prof.profiler.kineto_results.events():
        if e.name() in ("aten::_scaled_dot_product_efficient_attention",
                        "aten::_scaled_dot_product_efficient_attention_backward"):
            backward = e.name() in BACKWARD  # (grad_out, q, k, v, ...), else (q, k, v, ...)
            n = 4 if backward else 3
            seen.setdefault("backward" if backward else "forward", set()).update(
                (s[-1], t) for s, t in zip(e.shapes()[:n], e.dtypes()[:n]))
    return seen, q, results


def _check_results(q, results, head_dim):
    out, lse, dq, dk, dv = results
    assert out.shape == q.shape and dq.shape == q.shape and dk.shape == dv.shape
    assert dk.shape[-1] == head_dim
    assert {t.dtype for t in (out, dq, dk, dv)} == {q.dtype}


# The efficient kernels refuse rows that are not 16-byte aligned ("query is
# not correctly aligned (strideM)": bf16 head dim 36, the ring's masked tiles
# on an H200): such head dims are zero-padded at the call, as for flash.
@pytest.mark.parametrize("head_dim,dtype,seen", [
    (36, torch.bfloat16, 40), (36, torch.float16, 40), (36, torch.float32, 36),
    (20, torch.float32, 20), (64, torch.bfloat16, 64)], ids=["bf16-36", "fp16-36", "fp32-36",
                                                             "fp32-20", "bf16-64"])
def test_efficient_pads_unaligned_head_dims(head_dim, dtype, seen):
    inputs, q, results = _efficient_inputs(head_dim, dtype, masked=False)
    want = {(seen, PROFILED[dtype])}
    assert inputs == {"forward": want, "backward": want}, inputs
    _check_results(q, results, head_dim)


# A masked fp16/bf16 call (documents, a window, positions) whose head dim is
# no multiple of 8 is one no fused kernel takes, so SDPA computes it in fp32
# (its math path). Every block of such a ring call, a plain causal one
# (flash's, else) too, runs the efficient kernel in fp32 (padded and in bf16,
# dq was 1.6-2.2x SDPA's error on an H200), and returns the block's dtype.
UNALIGNED_MASKED_CALLS = [
    (36, torch.bfloat16, (36, "float")), (36, torch.float16, (36, "float")),
    (36, torch.float32, (36, "float")), (20, torch.float32, (20, "float")),
    (64, torch.bfloat16, (64, "c10::BFloat16"))]


@pytest.mark.parametrize("masked", [True, False], ids=["masked-block", "causal-block"])
@pytest.mark.parametrize("head_dim,dtype,seen", UNALIGNED_MASKED_CALLS,
                         ids=["bf16-36", "fp16-36", "fp32-36", "fp32-20", "bf16-64"])
def test_blocks_of_unaligned_half_masked_calls_run_in_fp32(head_dim, dtype, seen, masked):
    # "flash": what the ring picks for a plain causal block of such a call.
    inputs, q, results = _efficient_inputs(head_dim, dtype, masked, in_masked_call=True,
                                           backend="efficient" if masked else "flash")
    if masked or (dtype != torch.float32 and head_dim % 8):
        assert inputs == {"forward": {seen}, "backward": {seen}}, inputs
    else:  # flash keeps the block
        assert inputs == {}, inputs
    _check_results(q, results, head_dim)
