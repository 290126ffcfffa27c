// Block attention on CPU: ATen's flash kernel for CPU (lse is (B,H,L) in
// float32, float64 for float64 inputs, and strided).
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_backward.h>

#include <algorithm>

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

namespace {

// MLA: v's head dim may differ from q/k's. The kernels other than CUDA's
// efficient one need a single head dim, so the narrower side is zero-padded
// at the call (exact: zero q/k columns add nothing to the scores, zero v
// columns give zero output columns) and the results are sliced back. The
// scale was fixed from q's head dim in check_local_args.
bool pads(const Config& cfg, const at::Tensor& q, const at::Tensor& v, bool masked) {
  if (q.size(3) == v.size(3)) return false;
  if (!q.is_cuda()) return true;
  return !masked && cfg.backend != kBackendEfficient;
}

at::Tensor pad_to(const at::Tensor& t, int64_t d) {
  return t.size(3) == d ? t : at::constant_pad_nd(t, {0, d - t.size(3)}, 0);
}

BlockResult forward_kernel(const Config& cfg, const at::Tensor& q, const at::Tensor& k,
                           const at::Tensor& v, bool causal, const at::Tensor& mask) {
#ifdef CPLIB_WITH_CUDA
  if (q.is_cuda() && mask.defined()) return block_forward_cuda_masked(cfg, q, k, v, mask);
  if (q.is_cuda()) return block_forward_cuda(cfg, q, k, v, causal);
#endif
  return block_forward_cpu(cfg, q, k, v, causal, mask);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_kernel(
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

}  // namespace

BlockResult block_forward(const Config& cfg, const at::Tensor& q, const at::Tensor& k,
                          const at::Tensor& v, bool causal, const at::Tensor& mask) {
  if (!pads(cfg, q, v, mask.defined())) return forward_kernel(cfg, q, k, v, causal, mask);
  const int64_t d = std::max(q.size(3), v.size(3));
  BlockResult r = forward_kernel(cfg, pad_to(q, d), pad_to(k, d), pad_to(v, d), causal, mask);
  r.out = r.out.narrow(3, 0, v.size(3));
  return r;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> block_backward(
    const Config& cfg, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, bool causal,
    const at::Tensor& mask) {
  if (!pads(cfg, q, v, mask.defined()))
    return backward_kernel(cfg, grad_out, q, k, v, out, lse, causal, mask);
  const int64_t d = std::max(q.size(3), v.size(3));
  auto [gq, gk, gv] = backward_kernel(cfg, pad_to(grad_out, d), pad_to(q, d), pad_to(k, d),
                                      pad_to(v, d), pad_to(out, d), lse, causal, mask);
  return {gq.narrow(3, 0, q.size(3)), gk.narrow(3, 0, k.size(3)), gv.narrow(3, 0, v.size(3))};
}

}  // namespace cplib::ring
