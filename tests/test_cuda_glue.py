"""The CUDA glue, guarded on machines without a GPU.

1. Every op the native layer calls through torch's stable dispatcher (each
   ``"ns::op", "overload"`` pair named in csrc/) is audited on the running
   torch: no SymInt, SymBool or SymFloat in its schema's RETURNS (the stable
   call cannot convert them: "Expected Tensor but got Int", every flash and
   cuDNN call of a24d28d on an H100). Sym *arguments* convert; they are
   listed in SYM_ARGUMENTS.
2. ``cplib_c::_cuda_glue_probe`` runs one block forward and backward through
   the CUDA block helpers (ring_block_cuda*.cpp, common/aten.cpp) on META
   tensors, for every backend: the same helpers with the same arguments as on
   a GPU, through the same argument and return conversion.
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
CSRC = Path(os.environ.get("CPLIB_GLUE_CSRC", Path(__file__).resolve().parent.parent / "csrc"))

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
    "aten::masked_fill.Tensor": set(),
    "aten::movedim.int": set(),
    "aten::mul_.Tensor": set(),
    "aten::permute": set(),
    "aten::repeat": {"repeats"},
    "aten::view.dtype": set(),
    "aten::where.self": set(),
    "_c10d_functional::wait_tensor": set(),
    "cplib_c::_cudnn_attention": set(),
    "cplib_c::c10d_all_gather": set(),
    "cplib_c::c10d_all_to_all": set(),
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


def test_flash_forward_gets_every_argument_of_the_running_schema():
    # call() passes 17 arguments (torch 2.13's schema); a torch whose schema
    # reads more would read slots cplib never set.
    schema = _schema("aten::_flash_attention_forward")
    assert len(schema.arguments) <= 17, schema


BACKENDS = {"auto": -1, "flash": 1, "efficient": 2, "cudnn": 3}
CASES = [("flash", False), ("efficient", False), ("cudnn", False), ("efficient", True)]


def _meta(*shape, dtype):
    return torch.empty(*shape, device="meta", dtype=dtype)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("backend,masked", CASES, ids=[b + ("-masked" if m else "")
                                                       for b, m in CASES])
def test_block_forward_and_backward_on_meta(backend, masked, dtype, causal):
    b, h, lq, lk, d = 2, 4, 96, 160, 64
    q = _meta(b, h, lq, d, dtype=dtype)
    k, v = _meta(b, h, lk, d, dtype=dtype), _meta(b, h, lk, d, dtype=dtype)
    out, lse, dq, dk, dv = ops._cuda_glue_probe(q, k, v, BACKENDS[backend], causal and not masked,
                                                masked, True)
    assert (out.shape, out.dtype, out.device.type) == ((b, h, lq, d), dtype, "meta")
    assert (lse.shape, lse.dtype) == ((b, h, lq), torch.float32)
    for grad, like in ((dq, q), (dk, k), (dv, v)):
        assert (grad.shape, grad.dtype) == (like.shape, dtype)


def test_block_forward_only_on_meta():
    q = _meta(1, 2, 32, 64, dtype=torch.bfloat16)
    out, lse, dq, _, _ = ops._cuda_glue_probe(q, q, q, BACKENDS["flash"], True, False, False)
    assert out.shape == q.shape and lse.shape == (1, 2, 32) and dq.numel() == 0


def test_auto_asks_sdpa_and_refuses_the_math_backend():
    # On meta tensors SDPA's choice (_fused_sdp_choice, through the ring's own
    # resolve_backend_cuda) is the math backend, which returns no lse.
    q = _meta(1, 2, 32, 64, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="would pick backend 0"):
        ops._cuda_glue_probe(q, q, q, BACKENDS["auto"], True, False, True)


# ---------------------------------------------------------------- on a GPU

def _has_cuda_probe() -> bool:
    return (torch.cuda.is_available() and
            torch._C._dispatch_has_kernel_for_dispatch_key("cplib_c::_cuda_glue_probe", "CUDA"))


@pytest.mark.cuda
@pytest.mark.skipif(not _has_cuda_probe(),
                    reason="needs a CUDA GPU (none visible) and a CUDA build")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("backend,masked", CASES, ids=[b + ("-masked" if m else "")
                                                       for b, m in CASES])
def test_block_on_cuda_matches_fp64_math(backend, masked, causal):
    """The same probe on CUDA tensors: the kernels' out, lse and gradients
    (grad_out = 1) against fp64 math on the same inputs."""
    causal = causal and not masked
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 4, 128, 64, generator=g, dtype=torch.float64) for _ in range(3))
    dev = [t.to("cuda", torch.bfloat16) for t in (q, k, v)]
    out, lse, dq, dk, dv = ops._cuda_glue_probe(*dev, BACKENDS[backend], causal, masked, True)
    torch.cuda.synchronize()
    qr, kr, vr = (t.to(torch.bfloat16).double().requires_grad_(True) for t in (q, k, v))
    want, _ = torch.ops.aten._scaled_dot_product_attention_math(qr, kr, vr, None, 0.0, causal)
    want.sum().backward()
    scores = qr.detach() @ kr.detach().transpose(-1, -2) * 64 ** -0.5
    if causal:
        scores = scores.masked_fill(~torch.ones(128, 128, dtype=torch.bool).tril(), float("-inf"))
    want_lse = torch.logsumexp(scores, dim=-1)

    def rel(got, ref):
        return ((got.double().cpu() - ref).norm() / ref.norm()).item()
    errs = {"out": rel(out, want.detach()), "dq": rel(dq, qr.grad), "dk": rel(dk, kr.grad),
            "dv": rel(dv, vr.grad)}
    # bf16 inputs and outputs: a relative error of a few 1e-3 is rounding.
    assert all(e < 2e-2 for e in errs.values()), errs
    assert (lse.double().cpu() - want_lse).abs().max().item() < 2e-2
