// Block attention on CUDA: flash, efficient or cuDNN through ATen, chosen as
// scaled_dot_product_attention would (so torch.nn.attention.sdpa_kernel is
// honoured) unless the caller names one. Dropout is never used, so the
// backward kernels get placeholder philox tensors.
#ifdef CPLIB_WITH_CUDA

#include <ATen/ops/_fused_sdp_choice.h>
#include <ATen/ops/_scaled_dot_product_cudnn_attention.h>
#include <ATen/ops/_scaled_dot_product_cudnn_attention_backward.h>
#include <ATen/ops/_scaled_dot_product_efficient_attention.h>
#include <ATen/ops/_scaled_dot_product_efficient_attention_backward.h>
#include <ATen/ops/_scaled_dot_product_flash_attention.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_backward.h>

#include <limits>

#include "ring/ring_block.h"

namespace cplib::ring {
namespace {

int64_t pick_backend(const Config& cfg) {
  TORCH_CHECK(cfg.backend != kBackendAuto, "cplib.ring_sdpa: backend not resolved");
  return cfg.backend;
}

at::Tensor philox_placeholder(const at::Tensor& like) {
  return at::empty({}, like.options().dtype(at::kLong));
}

// A (B, H, L, D) view of `t` whose memory is (B, L, H, D)-dense, the layout
// the efficient kernels' outputs have and their backward assumes for `out`.
at::Tensor seq_major(const at::Tensor& t) {
  return t.transpose(1, 2).contiguous().transpose(1, 2);
}

// The efficient kernel pads its lse rows to a multiple of 32.
constexpr int64_t kEfficientLseAlign = 32;

}  // namespace

int64_t resolve_backend_cuda(int64_t backend, const at::Tensor& q, const at::Tensor& k,
                             const at::Tensor& v, bool causal, std::optional<double> scale) {
  if (backend != kBackendAuto) return backend;
  // The blocks see k/v expanded to q's heads: ask about that shape (a
  // stride-0 view, no copy).
  auto as_q_heads = [&q](const at::Tensor& t) {
    return t.narrow(1, 0, 1).expand({t.size(0), q.size(1), t.size(2), t.size(3)});
  };
  // MLA (v's head dim below q/k's): flash and cuDNN get v zero-padded to
  // q/k's head dim (ring_block_cpu.cpp), so ask about that shape.
  const at::Tensor& v_seen = v.size(3) < q.size(3) ? k : v;
  const int64_t b = at::_fused_sdp_choice(q, as_q_heads(k), as_q_heads(v_seen), std::nullopt,
                                          0.0, causal, scale, false);
  TORCH_CHECK_NOT_IMPLEMENTED(b == kBackendFlash || b == kBackendEfficient || b == kBackendCudnn,
                              "cplib.ring_sdpa: no fused SDPA backend returning a log-sum-exp "
                              "accepts these inputs (dtype ", q.scalar_type(), ", head dim ",
                              q.size(3), "); scaled_dot_product_attention would pick backend ", b);
  return b;
}

BlockResult block_forward_cuda(const Config& cfg, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, bool causal) {
  const int64_t Lq = q.size(2);
  switch (pick_backend(cfg)) {
    case kBackendFlash: {
      auto r = at::_scaled_dot_product_flash_attention(q, k, v, 0.0, causal, false, cfg.scale);
      return {std::get<0>(r), std::get<1>(r)};
    }
    case kBackendEfficient: {
      auto r = at::_scaled_dot_product_efficient_attention(q, k, v, std::nullopt, true, 0.0,
                                                           causal, cfg.scale);
      return {std::get<0>(r), std::get<1>(r).narrow(2, 0, Lq)};
    }
    default: {
      auto r = at::_scaled_dot_product_cudnn_attention(q, k, v, std::nullopt, true, 0.0, causal,
                                                       false, cfg.scale);
      at::Tensor lse = std::get<1>(r);
      return {std::get<0>(r), lse.dim() == 4 ? lse.squeeze(-1) : lse};  // (B,H,L,1) -> (B,H,L)
    }
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> block_backward_cuda(
    const Config& cfg, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, bool causal) {
  const int64_t Lq = q.size(2), Lk = k.size(2);
  const at::Tensor seed = philox_placeholder(q), offset = philox_placeholder(q);
  switch (pick_backend(cfg)) {
    case kBackendFlash:
      // Strided lse rows give wrong gradients in these kernels (upstream's note).
      return at::_scaled_dot_product_flash_attention_backward(
          grad_out.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), at::Tensor(),
          at::Tensor(), Lq, Lk, 0.0, causal, seed, offset, cfg.scale);
    case kBackendEfficient: {
      // The CUTLASS backward never reads out's row stride: it assumes the
      // (B, L, H, D)-dense memory its own forward returns (o_strideM() =
      // num_heads * head_dim in kernel_backward.h) when the f16/bf16 kernels
      // compute delta = rowsum(dO * O). A (B, H, L, D)-contiguous `out` was
      // read at the wrong rows and past its end: NaN or wrong dq/dk (dv, which
      // needs no delta, stayed right).
      const int64_t padded = (Lq + kEfficientLseAlign - 1) / kEfficientLseAlign * kEfficientLseAlign;
      // Padded as the forward pads it (+inf: those rows get probability 0).
      at::Tensor lse_padded = at::full({lse.size(0), lse.size(1), padded},
                                       std::numeric_limits<double>::infinity(), lse.options());
      lse_padded.narrow(2, 0, Lq).copy_(lse);
      auto r = at::_scaled_dot_product_efficient_attention_backward(
          seq_major(grad_out), q, k, v, at::Tensor(), seq_major(out), lse_padded, seed, offset,
          0.0, {true, true, true, false}, causal, cfg.scale);
      return {std::get<0>(r), std::get<1>(r), std::get<2>(r)};
    }
    default:
      return at::_scaled_dot_product_cudnn_attention_backward(
          grad_out.contiguous(), q, k, v, out.contiguous(), lse.unsqueeze(-1).contiguous(), seed,
          offset, at::Tensor(), at::Tensor(), at::Tensor(), Lq, Lk, 0.0, causal, cfg.scale);
  }
}

}  // namespace cplib::ring

#endif  // CPLIB_WITH_CUDA
