// Block attention on CUDA: flash, efficient or cuDNN through ATen, chosen as
// scaled_dot_product_attention would (so torch.nn.attention.sdpa_kernel is
// honoured) unless the caller names one. Dropout is never used, so the
// backward kernels get placeholder philox tensors.
// Compiled into every build: no CUDA runtime call here, and the CPU build's
// guard (cuda_glue_probe.cpp) runs these functions on meta tensors.

#include <limits>

#include "common/aten.h"
#include "ring/ring_block.h"

namespace cplib::ring {
namespace {

int64_t pick_backend(const Config& cfg) {
  CPLIB_CHECK(cfg.backend != kBackendAuto, "cplib.ring_sdpa: backend not resolved");
  return cfg.backend;
}

Tensor philox_placeholder(const Tensor& like) {
  return aten::empty({}, aten::opts_of(like).dtype_(ScalarType::Long));
}

// A (B, H, L, D) view of `t` whose memory is (B, L, H, D)-dense, the layout
// the efficient kernels' outputs have and their backward assumes for `out`.
Tensor seq_major(const Tensor& t) {
  return torch::stable::transpose(aten::contiguous(torch::stable::transpose(t, 1, 2)), 1, 2);
}

// The efficient kernel pads its lse rows to a multiple of 32.
constexpr int64_t kEfficientLseAlign = 32;

}  // namespace

int64_t resolve_backend_cuda(int64_t backend, const Tensor& q, const Tensor& k,
                             const Tensor& v, bool causal, std::optional<double> scale) {
  if (backend != kBackendAuto) return backend;
  // The blocks see k/v expanded to q's heads: ask about that shape (a
  // stride-0 view, no copy).
  auto as_q_heads = [&q](const Tensor& t) {
    return aten::expand(aten::narrow(t, 1, 0, 1), {t.size(0), q.size(1), t.size(2), t.size(3)});
  };
  // MLA (v's head dim below q/k's): flash and cuDNN get v zero-padded to
  // q/k's head dim (ring_block_cpu.cpp), so ask about that shape.
  const Tensor& v_seen = v.size(3) < q.size(3) ? k : v;
  const int64_t b = aten::fused_sdp_choice(q, as_q_heads(k), as_q_heads(v_seen), causal, scale);
  CPLIB_CHECK_NOT_IMPLEMENTED(b == kBackendFlash || b == kBackendEfficient || b == kBackendCudnn,
                              "cplib.ring_sdpa: no fused SDPA backend returning a log-sum-exp "
                              "accepts these inputs (dtype ",
                              torch::headeronly::toString(q.scalar_type()), ", head dim ",
                              q.size(3), "); scaled_dot_product_attention would pick backend ", b);
  return b;
}

BlockResult block_forward_cuda(const Config& cfg, const Tensor& q, const Tensor& k,
                               const Tensor& v, bool causal) {
  const int64_t Lq = q.size(2);
  switch (pick_backend(cfg)) {
    case kBackendFlash: {
      auto [out, lse] = aten::flash_cuda(q, k, v, causal, cfg.scale);
      return {out, lse};
    }
    case kBackendEfficient: {
      auto [out, lse] = aten::efficient_cuda(q, k, v, std::nullopt, causal, cfg.scale);
      return {out, aten::narrow(lse, 2, 0, Lq)};
    }
    default: {
      auto [out, lse] = aten::cudnn_cuda(q, k, v, causal, cfg.scale);
      // (B,H,L,1) -> (B,H,L)
      return {out, lse.dim() == 4 ? torch::stable::squeeze(lse, -1) : lse};
    }
  }
}

std::tuple<Tensor, Tensor, Tensor> block_backward_cuda(
    const Config& cfg, const Tensor& grad_out, const Tensor& q, const Tensor& k,
    const Tensor& v, const Tensor& out, const Tensor& lse, bool causal) {
  const int64_t Lq = q.size(2), Lk = k.size(2);
  const Tensor seed = philox_placeholder(q), offset = philox_placeholder(q);
  switch (pick_backend(cfg)) {
    case kBackendFlash:
      // Strided lse rows give wrong gradients in these kernels (upstream's note).
      return aten::flash_cuda_backward(aten::contiguous(grad_out), q, k, v, aten::contiguous(out),
                                       aten::contiguous(lse), Lq, Lk, causal, seed, offset,
                                       cfg.scale);
    case kBackendEfficient: {
      // The CUTLASS backward never reads out's row stride: it assumes the
      // (B, L, H, D)-dense memory its own forward returns (o_strideM() =
      // num_heads * head_dim in kernel_backward.h) when the f16/bf16 kernels
      // compute delta = rowsum(dO * O). A (B, H, L, D)-contiguous `out` was
      // read at the wrong rows and past its end: NaN or wrong dq/dk (dv, which
      // needs no delta, stayed right).
      const int64_t padded = (Lq + kEfficientLseAlign - 1) / kEfficientLseAlign * kEfficientLseAlign;
      // Padded as the forward pads it (+inf: those rows get probability 0).
      Tensor lse_padded = aten::full({lse.size(0), lse.size(1), padded},
                                     std::numeric_limits<double>::infinity(), aten::opts_of(lse));
      aten::copy_(aten::narrow(lse_padded, 2, 0, Lq), lse);
      return aten::efficient_cuda_backward(seq_major(grad_out), q, k, v, Tensor(), seq_major(out),
                                           lse_padded, seed, offset, causal, cfg.scale);
    }
    default:
      return aten::cudnn_cuda_backward(aten::contiguous(grad_out), q, k, v, aten::contiguous(out),
                                       aten::contiguous(torch::stable::unsqueeze(lse, -1)), seed,
                                       offset, Lq, Lk, causal, cfg.scale);
  }
}

}  // namespace cplib::ring
