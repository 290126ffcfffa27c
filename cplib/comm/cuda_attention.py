"""``cplib_c::_cudnn_attention``: ATen's cuDNN attention forward for the
native layer, which cannot call it itself. Both of ATen's cuDNN forward ops
(``_scaled_dot_product_cudnn_attention``, ``_cudnn_attention_forward``)
return ``max_q``/``max_k`` as SymInts, and torch's stable dispatcher call
converts no SymInt return ("Expected Tensor but got Int"; DESIGN.md §10).
This op calls the ATen op and returns its tensors only; csrc/torch/common/
aten.cpp (cudnn_cuda) calls it through the dispatcher, one Python round
trip per block forward."""

from __future__ import annotations

import torch

_lib = torch.library.Library("cplib_c", "FRAGMENT")
_lib.define("_cudnn_attention(Tensor query, Tensor key, Tensor value, bool is_causal, "
            "float? scale) -> (Tensor out, Tensor lse)")


def _cudnn_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     is_causal: bool, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    # No bias, the log-sum-exp computed, no dropout, no debug mask.
    result = torch.ops.aten._scaled_dot_product_cudnn_attention(
        query, key, value, None, True, 0.0, is_causal, False, scale=scale)
    return result[0], result[1]


# CompositeExplicitAutograd: CUDA tensors on a GPU, meta tensors in the CPU
# guard (tests/test_cuda_glue.py); grad mode is off inside the native kernels.
_lib.impl("_cudnn_attention", _cudnn_attention, "CompositeExplicitAutograd")
