// ATen's fused attention kernels that return the log-sum-exp, one typed
// wrapper each through the stable dispatcher call: the CPU flash kernel and
// CUDA's flash, memory-efficient and cuDNN kernels, with their backwards,
// and ATen's choice among them. The block kernels (block.h) call these.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/stable.h"

// Internal to the extension (torch's stable types are hidden).
#pragma GCC visibility push(hidden)

namespace cplib::attention {

// ATen's CPU flash kernel (and its backward): (out, lse).
std::tuple<Tensor, Tensor> flash_cpu(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                                     const std::optional<Tensor>& mask,
                                     std::optional<double> scale);
std::tuple<Tensor, Tensor, Tensor> flash_cpu_backward(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
    const Tensor& lse, bool causal, const std::optional<Tensor>& mask, std::optional<double> scale);

// CUDA's fused kernels. Compiled into every build (no CUDA runtime call):
// the CPU build reaches them on meta tensors in the guard
// (ring/cuda_glue_probe.cpp), through the same conversions a GPU run takes.
// None of the ops behind them returns a SymInt (see common/dispatch.h).
int64_t fused_sdp_choice(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                         std::optional<double> scale);
// (B, H, L, D) in and out; lse (B, H, Lq) float32. Head dims that are not
// a multiple of 8 are zero-padded at the call (as SDPA does), the scale
// taken from the real one (nullopt: 1/sqrt of q's head dim).
std::tuple<Tensor, Tensor> flash_cuda(const Tensor& q, const Tensor& k, const Tensor& v,
                                      bool causal, std::optional<double> scale);
std::tuple<Tensor, Tensor, Tensor> flash_cuda_backward(const Tensor& grad_out, const Tensor& q,
                                                       const Tensor& k, const Tensor& v,
                                                       const Tensor& out, const Tensor& lse,
                                                       int64_t max_q, int64_t max_k, bool causal,
                                                       const Tensor& seed, const Tensor& offset,
                                                       std::optional<double> scale);
// The argument names cplib passes to aten::_flash_attention_forward, in
// order: the running torch's schema (asked once; a name cplib cannot fill
// raises NotImplementedError).
std::vector<std::string> flash_forward_argument_names();
// The memory-efficient kernels: head dims whose rows are not 16-byte aligned
// (bf16/fp16: a multiple of 8; fp32: of 4) are zero-padded at the call, the
// scale taken from the real one; the backward's out and grad_out as
// block_cuda.cpp passes them, (B, L, H, D)-dense.
std::tuple<Tensor, Tensor> efficient_cuda(const Tensor& q, const Tensor& k, const Tensor& v,
                                          const std::optional<Tensor>& bias, bool causal,
                                          std::optional<double> scale);
std::tuple<Tensor, Tensor, Tensor> efficient_cuda_backward(const Tensor& grad_out, const Tensor& q,
                                                           const Tensor& k, const Tensor& v,
                                                           const Tensor& bias, const Tensor& out,
                                                           const Tensor& lse, const Tensor& seed,
                                                           const Tensor& offset, bool causal,
                                                           std::optional<double> scale);
// Through cplib_c::_cudnn_attention (cplib/comm/cuda_attention.py): lse (B, H, Lq, 1).
std::tuple<Tensor, Tensor> cudnn_cuda(const Tensor& q, const Tensor& k, const Tensor& v,
                                      bool causal, std::optional<double> scale);
// Every cuDNN forward of one ring step in one call of
// cplib_c::_cudnn_attention_step: (out, lse (B, H, Lq, 1)) per block.
std::vector<std::pair<Tensor, Tensor>> cudnn_cuda_step(const std::vector<Tensor>& q,
                                                       const std::vector<Tensor>& k,
                                                       const std::vector<Tensor>& v,
                                                       const std::vector<int64_t>& causal,
                                                       std::optional<double> scale);
std::tuple<Tensor, Tensor, Tensor> cudnn_cuda_backward(const Tensor& grad_out, const Tensor& q,
                                                       const Tensor& k, const Tensor& v,
                                                       const Tensor& out, const Tensor& lse,
                                                       const Tensor& seed, const Tensor& offset,
                                                       int64_t max_q, int64_t max_k, bool causal,
                                                       std::optional<double> scale);

}  // namespace cplib::attention

#pragma GCC visibility pop
