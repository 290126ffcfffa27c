// Block attention on CPU: ATen's flash kernel for CPU (lse is (B,H,L) in
// float32, float64 for float64 inputs, and strided).
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_backward.h>

#include "ring/ring_block.h"

namespace cplib::ring {
namespace {


std::optional<at::Tensor> optional(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

}  // namespace

BlockResult block_forward_cpu(const Config& cfg, const at::Tensor& q, const at::Tensor& k,
                              const at::Tensor& v, bool causal, const at::Tensor& mask) {
  auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(
      q, k, v, /*dropout_p=*/0.0, causal, optional(mask), cfg.scale);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> block_backward_cpu(
    const Config& cfg, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, bool causal,
    const at::Tensor& mask) {
  return at::_scaled_dot_product_flash_attention_for_cpu_backward(
      grad_out, q, k, v, out, lse, /*dropout_p=*/0.0, causal, optional(mask), cfg.scale);
}

BlockResult block_forward(const Config& cfg, const at::Tensor& q, const at::Tensor& k,
                          const at::Tensor& v, bool causal, const at::Tensor& mask) {
#ifdef CPLIB_WITH_CUDA
  if (q.is_cuda() && mask.defined()) return block_forward_cuda_masked(cfg, q, k, v, mask);
  if (q.is_cuda()) return block_forward_cuda(cfg, q, k, v, causal);
#endif
  return block_forward_cpu(cfg, q, k, v, causal, mask);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> block_backward(
    const Config& cfg, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, bool causal,
    const at::Tensor& mask) {
#ifdef CPLIB_WITH_CUDA
  if (q.is_cuda() && mask.defined())
    return block_backward_cuda_masked(cfg, grad_out, q, k, v, out, lse, mask);
  if (q.is_cuda()) return block_backward_cuda(cfg, grad_out, q, k, v, out, lse, causal);
#endif
  return block_backward_cpu(cfg, grad_out, q, k, v, out, lse, causal, mask);
}

}  // namespace cplib::ring
