"""The CUDA glue, guarded on machines without a GPU.

1. Every op the native layer calls through torch's stable dispatcher (each
   ``"ns::op", "overload"`` pair named in csrc/) is audited on the running
   torch: no SymInt, SymBool or SymFloat in its schema's RETURNS (the stable
   call cannot convert them: "Expected Tensor but got Int", every flash and
   cuDNN call of a24d28d on an H100). Sym *arguments* convert; they are
   listed in SYM_ARGUMENTS.
2. ``aten::_flash_attention_forward`` gets exactly the running torch's
   argument list (15 arguments on torch 2.11, 17 from 2.13): names, order and
   types are checked against the running schema (``make test-torch
   TORCH=oldest|newest TESTS=tests/comm/test_cuda_glue.py`` runs this on 2.11 and
   2.15).
3. ``cplib_c::_cuda_glue_probe`` runs one block forward and backward along
   the ring's own route to the CUDA kernels (K|V packed as they travel, GQA
   heads expanded, the backend resolved as the ring resolves it,
   block_forward/block_backward with the scale and MLA padding, the fp32 lse
   rows of the accumulator fed to the backward, gradients summed back over
   GQA groups) on META tensors, for every backend: the same functions with the
   same arguments as on a GPU, through the same argument and return
   conversion. Flash with a head dim that is not a multiple of 8 gets it
   zero-padded at the call, scaled by the real one (torch.profiler's record
   of the ATen call shows the shapes and the scale flash receives).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

import cplib  # noqa: F401  (registers the ops)
from cplib.comm.native import ops

# The csrc/ to audit (CPLIB_GLUE_CSRC: another checkout's, e.g. an old commit's).
CSRC = Path(os.environ.get("CPLIB_GLUE_CSRC", Path(__file__).resolve().parents[2] / "csrc"))

# The op name and overload of every dispatcher call: call("aten::x", "overload", ...).
_CALL = re.compile(r'"((?:aten|_c10d_functional|cplib_c)::\w+)",\s*"(\w*)"')
_SYM = re.compile(r"\bSym(Int|Bool|Float)\b")

# Every op csrc/ calls through the dispatcher, with the Sym-typed ARGUMENTS its
# schema has on some supported torch (2.11-2.15). They convert; a Sym RETURN
# does not, and none may appear.
SYM_ARGUMENTS: dict[str, set[str]] = {
    "aten::_flash_attention_forward": {"max_q", "max_k", "window_size_left",
                                       "window_size_right"},
    "aten::_scaled_dot_product_flash_attention_backward": {"max_q", "max_k"},
    "aten::_scaled_dot_product_cudnn_attention_backward": {"max_q", "max_k"},
    "aten::_scaled_dot_product_efficient_attention": set(),
    "aten::_scaled_dot_product_efficient_attention_backward": set(),
    "aten::_scaled_dot_product_flash_attention_for_cpu": set(),
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": set(),
    "aten::_fused_sdp_choice": set(),
    "aten::any.dim": set(),
    "aten::cat": set(),
    "aten::convolution": {"padding", "stride", "dilation", "output_padding", "groups"},
    "aten::convolution_backward": {"bias_sizes", "padding", "stride", "dilation",
                                   "output_padding", "groups"},
    "aten::empty_strided": {"size", "stride"},
    "aten::eq.Tensor": set(),
    "aten::exp": set(),
    "aten::expand": {"size"},
    "aten::ge.Tensor": set(),
    "aten::le.Tensor": set(),
    "aten::logaddexp": set(),
    "aten::logical_and": set(),
    "aten::logical_not": set(),
    "aten::movedim.int": set(),
    "aten::mul_.Tensor": set(),
    "aten::permute": set(),
    "aten::repeat": {"repeats"},
    "aten::where.self": set(),
    "_c10d_functional::wait_tensor": set(),
    "cplib_c::_cudnn_attention": set(),
    "cplib_c::_cudnn_attention_step": set(),
    "cplib_c::_schema_arguments": set(),
    "cplib_c::c10d_all_gather": set(),
    "cplib_c::c10d_all_to_all": set(),
    "cplib_c::c10d_send_recv": set(),
    "cplib_c::c10d_reduce_scatter_sum": set(),
    "cplib_c::group_info": set(),
}


def dispatched_ops() -> dict[str, list[str]]:
    """{"ns::op.overload": [files naming it]} for every dispatcher call in csrc/."""
    found: dict[str, list[str]] = {}
    for path in sorted(CSRC.rglob("*")):
        if path.suffix not in (".cpp", ".h", ".cu"):
            continue
        for name, overload in _CALL.findall(path.read_text()):
            key = f"{name}.{overload}" if overload else name
            found.setdefault(key, []).append(str(path.relative_to(CSRC)))
    return found


def _schema(qualified: str):
    name, _, overload = qualified.partition(".")
    return torch._C._get_schema(name, overload)


def _split_top(text: str) -> list[str]:
    """Splits at the commas outside brackets ("int[2] stride=[1, 1]" stays whole)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch in "([" and 1 or ch in ")]" and -1 or 0
        if ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    last = text[start:].strip()
    return parts + [last] if last else parts


def typed_fields(schema) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """([(type, name)] of the arguments, [(type, name)] of the returns), read
    from the schema's text: the Python Argument.type of a SymInt says "int"
    (only the text keeps SymInt/SymBool/SymFloat)."""
    text = str(schema)
    head, _, rets = text.rpartition(" -> ")
    args = head[head.index("(") + 1:head.rindex(")")]

    def fields(items: list[str]) -> list[tuple[str, str]]:
        out = []
        for item in items:
            if item == "*":
                continue
            typ, _, rest = item.partition(" ")
            out.append((typ, rest.split("=")[0].strip()))
        return out
    rets = rets.strip()
    ret_items = _split_top(rets[1:-1]) if rets.startswith("(") else [rets]
    return fields(_split_top(args)), fields(ret_items)


def test_the_audited_list_is_every_op_csrc_calls():
    found = dispatched_ops()
    assert found, f"no dispatcher calls found under {CSRC}"
    assert set(found) == set(SYM_ARGUMENTS), (
        f"csrc/ calls ops missing from SYM_ARGUMENTS: {sorted(set(found) - set(SYM_ARGUMENTS))}; "
        f"listed but no longer called: {sorted(set(SYM_ARGUMENTS) - set(found))}")


# Every op listed or called (a call missing from the list is audited too).
@pytest.mark.parametrize("qualified", sorted(set(SYM_ARGUMENTS) | set(dispatched_ops())))
def test_no_called_op_returns_a_sym_value(qualified):
    if qualified not in dispatched_ops():
        pytest.skip(f"{qualified} is not called from {CSRC}")
    schema = _schema(qualified)
    args, returns = typed_fields(schema)
    assert len(returns) == len(schema.returns) and len(args) == len(schema.arguments), schema
    sym_returns = [f"{typ} {name or i}" for i, (typ, name) in enumerate(returns)
                   if _SYM.search(typ)]
    assert not sym_returns, (
        f"{schema} returns {sym_returns} on torch {torch.__version__}: the stable dispatcher "
        "call cannot convert a Sym return (\"Expected Tensor but got Int\"); call an op "
        "returning tensors only, or a Python op (cplib/comm/cuda_attention.py)")
    sym_args = {name for typ, name in args if _SYM.search(typ)}
    unlisted = sorted(sym_args - SYM_ARGUMENTS.get(qualified, set()))
    assert not unlisted, (
        f"{qualified} has Sym arguments {unlisted} not "
        "listed in SYM_ARGUMENTS")


# The type cplib passes for each argument of aten::_flash_attention_forward it
# knows (csrc/torch/attention/kernels.cpp: FlashArg), as the schema spells it.
FLASH_ARGUMENT_TYPES = {
    "query": "Tensor", "key": "Tensor", "value": "Tensor", "cum_seq_q": "Tensor?",
    "cum_seq_k": "Tensor?", "max_q": "SymInt", "max_k": "SymInt", "dropout_p": "float",
    "is_causal": "bool", "return_debug_mask": "bool", "scale": "float?",
    "window_size_left": "SymInt?", "window_size_right": "SymInt?", "seqused_k": "Tensor?",
    "alibi_slopes": "Tensor?", "block_table": "Tensor?", "num_splits": "int?",
}


def test_flash_forward_gets_the_running_schemas_arguments_in_order():
    # The stable call reads as many stack slots as the RUNNING schema has
    # arguments: cplib passes exactly that list, by name, in its order.
    args, _ = typed_fields(_schema("aten::_flash_attention_forward"))
    passed = list(ops._flash_forward_arguments())
    assert passed == [name for _, name in args], (torch.__version__, passed, args)
    for typ, name in args:
        assert FLASH_ARGUMENT_TYPES.get(name) == typ, (
            f"torch {torch.__version__}: _flash_attention_forward's {name} is {typ}; cplib "
            f"passes {FLASH_ARGUMENT_TYPES.get(name)}")


CASES = [("flash", False), ("efficient", False), ("cudnn", False), ("efficient", True)]
# (q heads, k/v heads, q/k head dim, v head dim): MHA, GQA, MLA, and a head
# dim that is not a multiple of 8.
SHAPES = {"mha": (4, 4, 64, 64), "gqa": (4, 2, 64, 64), "mla": (4, 2, 64, 32),
          "d60": (4, 4, 60, 60)}


def _meta(*shape, dtype):
    return torch.empty(*shape, device="meta", dtype=dtype)


def _inputs(shape: str, dtype, lq: int = 96, lk: int = 160):
    hq, hkv, d, dv = SHAPES[shape]
    return (_meta(2, hq, lq, d, dtype=dtype), _meta(2, hkv, lk, d, dtype=dtype),
            _meta(2, hkv, lk, dv, dtype=dtype))


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("backend,masked", CASES, ids=[b + ("-masked" if m else "")
                                                       for b, m in CASES])
def test_block_forward_and_backward_on_meta(backend, masked, dtype, causal, shape):
    q, k, v = _inputs(shape, dtype)
    out, lse, dq, dk, dv = ops._cuda_glue_probe(q, k, v, backend, causal and not masked,
                                                masked, True, 0.125)
    b, h, lq, _ = q.shape
    assert (out.shape, out.dtype, out.device.type) == ((b, h, lq, v.shape[3]), dtype, "meta")
    assert (lse.shape, lse.dtype) == ((b, h, lq), torch.float32)
    for grad, like in ((dq, q), (dk, k), (dv, v)):
        assert (grad.shape, grad.dtype) == (like.shape, dtype)


def _flash_calls(prof) -> list:
    return [e for e in prof.events() if e.name in (
        "aten::_flash_attention_forward", "aten::_scaled_dot_product_flash_attention_backward")]


@pytest.mark.parametrize("scale", [None, 0.3], ids=["default-scale", "scale"])
def test_flash_pads_head_dims_to_a_multiple_of_8_at_the_call(scale):
    # SDPA pads before flash (which rejects other head dims); cplib does the
    # same at the kernel call, with the scale of the real head dim, and slices
    # the results back.
    q, k, v = _inputs("d60", torch.bfloat16, lq=32, lk=48)
    with torch.profiler.profile(record_shapes=True) as prof:
        out, _, dq, dk, dv = ops._cuda_glue_probe(q, k, v, "flash", False, False, True,
                                                  *([] if scale is None else [scale]))
    calls = _flash_calls(prof)
    want = 60 ** -0.5 if scale is None else scale
    for e in calls:
        tensors = [s for s in e.input_shapes if len(s) == 4]
        assert tensors and all(s[-1] == 64 for s in tensors), (e.name, e.input_shapes)
        scales = [x for x in e.concrete_inputs if isinstance(x, float) and x not in (0.0,)]
        assert scales and abs(scales[-1] - want) < 1e-12, (e.name, e.concrete_inputs)
    # The forward, and the backward in two row halves (as the probe runs it).
    assert [e.name for e in calls] == ["aten::_flash_attention_forward"] + \
        ["aten::_scaled_dot_product_flash_attention_backward"] * 2, [e.name for e in calls]
    for got, like in ((out, q), (dq, q), (dk, k), (dv, v)):
        assert got.shape == like.shape, (got.shape, like.shape)


def test_block_forward_only_on_meta():
    q = _meta(1, 2, 32, 64, dtype=torch.bfloat16)
    out, lse, dq, _, _ = ops._cuda_glue_probe(q, q, q, "flash", True, False, False)
    assert out.shape == q.shape and lse.shape == (1, 2, 32) and dq.numel() == 0


def test_auto_asks_sdpa_and_refuses_the_math_backend():
    # On meta tensors SDPA's choice (_fused_sdp_choice, through the ring's own
    # resolve_ring_backend) is the math backend, which returns no lse.
    q = _meta(1, 2, 32, 64, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="would pick backend 0"):
        ops._cuda_glue_probe(q, q, q, "auto", True, False, True)


# ---------------------------------------------------------------- on a GPU

def _has_cuda_probe() -> bool:
    return (torch.cuda.is_available() and
            torch._C._dispatch_has_kernel_for_dispatch_key("cplib_c::_cuda_glue_probe", "CUDA"))


# The ring's blocks plus the smallest ones ragged lengths give: cuDNN serves
# the 1x1 block's forward but not its backward, which cplib runs on the
# efficient kernel (tests/comm/test_cuda_block_kernel.py); 2x1 in two row
# halves when not causal.
GPU_CASES = [(b, m, 128, 128) for b, m in CASES] + [("cudnn", False, 1, 1), ("cudnn", False, 2, 1)]


@pytest.mark.cuda
@pytest.mark.skipif(not _has_cuda_probe(),
                    reason="needs a CUDA GPU (none visible) and a CUDA build")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("backend,masked,lq,lk", GPU_CASES, ids=[
    b + ("-masked" if m else "") + ("" if lq == 128 else f"-q{lq}k{lk}")
    for b, m, lq, lk in GPU_CASES])
def test_block_on_cuda_matches_fp64_math(backend, masked, lq, lk, causal):
    """The same probe on CUDA tensors: the kernels' out, lse and gradients
    (grad_out = 1) against fp64 math on the same inputs."""
    causal = causal and not masked
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, lq, 64, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 4, lk, 64, generator=g, dtype=torch.float64) for _ in range(2))
    dev = [t.to("cuda", torch.bfloat16) for t in (q, k, v)]
    out, lse, dq, dk, dv = ops._cuda_glue_probe(*dev, backend, causal, masked, True)
    torch.cuda.synchronize()
    qr, kr, vr = (t.to(torch.bfloat16).double().requires_grad_(True) for t in (q, k, v))
    want, _ = torch.ops.aten._scaled_dot_product_attention_math(qr, kr, vr, None, 0.0, causal)
    want.sum().backward()
    scores = qr.detach() @ kr.detach().transpose(-1, -2) * 64 ** -0.5
    if causal:
        scores = scores.masked_fill(~torch.ones(lq, lk, dtype=torch.bool).tril(), float("-inf"))
    want_lse = torch.logsumexp(scores, dim=-1)

    def rel(got, ref):  # absolute where the truth is 0 (dq, dk against a single key)
        return ((got.double().cpu() - ref).norm() / (ref.norm() if ref.norm() > 0 else 1)).item()
    errs = {"out": rel(out, want.detach()), "dq": rel(dq, qr.grad), "dk": rel(dk, kr.grad),
            "dv": rel(dv, vr.grad)}
    # bf16 inputs and outputs: a relative error of a few 1e-3 is rounding.
    assert all(e < 2e-2 for e in errs.values()), errs
    assert (lse.double().cpu() - want_lse).abs().max().item() < 2e-2
