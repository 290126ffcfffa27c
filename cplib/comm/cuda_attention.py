"""What the native layer's CUDA glue needs from Python.

``cplib_c::_cudnn_attention``: ATen's cuDNN attention forward, which the
native layer cannot call itself. Both of ATen's cuDNN forward ops
(``_scaled_dot_product_cudnn_attention``, ``_cudnn_attention_forward``)
return ``max_q``/``max_k`` as SymInts, and torch's stable dispatcher call
converts no SymInt return ("Expected Tensor but got Int", torch 2.11 to
2.15; see docs/ring.md, "CUDA kernels"). This op calls the ATen op and
returns its tensors only; csrc/torch/attention/kernels.cpp (cudnn_cuda) calls it
through the dispatcher, one Python round trip per block forward.

``cplib_c::_cudnn_attention_step``: the same for every cuDNN block of one
ring step at once (a step of a ring with documents or a window makes several
calls), so that a ring step costs at most one Python round trip on the CUDA
route (csrc/torch/ring/ring_forward.cpp; tests/comm/test_cuda_step_calls.py
counts them on meta tensors).

``cplib_c::_schema_arguments``: the argument names of an op on the running
torch, which the stable ABI cannot read; aten.cpp asks it once for
``aten::_flash_attention_forward``, whose argument list grew in torch 2.13,
so that the call passes exactly the running torch's arguments."""

from __future__ import annotations

import torch

_lib = torch.library.Library("cplib_c", "FRAGMENT")
_lib.define("_cudnn_attention(Tensor query, Tensor key, Tensor value, bool is_causal, "
            "float? scale) -> (Tensor out, Tensor lse)")
_lib.define("_cudnn_attention_step(Tensor[] query, Tensor[] key, Tensor[] value, "
            "int[] is_causal, float? scale) -> (Tensor[] out, Tensor[] lse)")
_lib.define("_schema_arguments(str name, str overload) -> str[]")


def _schema_arguments(name: str, overload: str) -> list[str]:
    return [a.name for a in torch._C._get_schema(name, overload).arguments]


def _cudnn_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     is_causal: bool, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    # No bias, the log-sum-exp computed, no dropout, no debug mask.
    result = torch.ops.aten._scaled_dot_product_cudnn_attention(
        query, key, value, None, True, 0.0, is_causal, False, scale=scale)
    return result[0], result[1]


def _cudnn_attention_step(query: list[torch.Tensor], key: list[torch.Tensor],
                          value: list[torch.Tensor], is_causal: list[int],
                          scale: float | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    outs, lses = [], []
    for q, k, v, causal in zip(query, key, value, is_causal, strict=True):
        out, lse = _cudnn_attention(q, k, v, bool(causal), scale)
        outs.append(out)
        lses.append(lse)
    return outs, lses


# CompositeExplicitAutograd: CUDA tensors on a GPU, meta tensors in the CPU
# guard (tests/comm/test_cuda_glue.py); grad mode is off inside the native kernels.
_lib.impl("_cudnn_attention", _cudnn_attention, "CompositeExplicitAutograd")
_lib.impl("_cudnn_attention_step", _cudnn_attention_step, "CompositeExplicitAutograd")
_lib.impl("_schema_arguments", _schema_arguments, "CompositeExplicitAutograd")
