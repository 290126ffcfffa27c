// Block attention on CUDA: flash, efficient or cuDNN through ATen, chosen as
// scaled_dot_product_attention would (so torch.nn.attention.sdpa_kernel is
// honoured) unless the caller names one. Dropout is never used, so the
// backward kernels get placeholder philox tensors.
// Compiled into every build: no CUDA runtime call here, and the CPU build's
// guard (cuda_glue_probe.cpp) runs these functions on meta tensors.

#include <algorithm>

#include "common/aten.h"
#include "ring/cuda_tiles.h"
#include "ring/ring_block.h"

namespace cplib::ring {
namespace {

int64_t pick_backend(const Config& cfg) {
  // Resolved before the first exchange, alike on every rank (resolve_ring_backend).
  CPLIB_ASSERT(cfg.backend != kBackendAuto);
  return cfg.backend;
}

int64_t checked_choice(int64_t b, const Tensor& like, int64_t head_dim) {
  CPLIB_CHECK_NOT_IMPLEMENTED(b == kBackendFlash || b == kBackendEfficient || b == kBackendCudnn,
                              "cplib.ring_sdpa: no fused SDPA backend returning a log-sum-exp "
                              "accepts these inputs (dtype ",
                              torch::headeronly::toString(like.scalar_type()), ", head dim ",
                              head_dim, "); scaled_dot_product_attention would pick backend ", b);
  return b;
}

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
  return checked_choice(aten::fused_sdp_choice(q, as_q_heads(k), as_q_heads(v_seen), causal, scale),
                        q, q.size(3));
}

int64_t resolve_backend_cuda(int64_t backend, const Tensor& like, const BlockShape& shape,
                             bool causal, std::optional<double> scale) {
  if (backend != kBackendAuto) return backend;
  // Stand-ins of the given sizes, dense (B, H, L, D) strides, over one small
  // buffer: _fused_sdp_choice reads sizes, strides, dtype and device, never
  // the data, so they need no memory of their own. MLA as above.
  const int64_t dv = shape.v_head_dim < shape.head_dim ? shape.head_dim : shape.v_head_dim;
  const Tensor buf = aten::empty({std::max(shape.head_dim, dv)}, aten::opts_of(like));
  auto stand_in = [&](int64_t len, int64_t d) {
    const std::vector<int64_t> sizes{shape.batch, shape.heads, len, d};
    return aten::reinterpret(buf, sizes, aten::contiguous_strides(sizes), 0);
  };
  const int64_t b = aten::fused_sdp_choice(stand_in(shape.q_len, shape.head_dim),
                                           stand_in(shape.kv_len, shape.head_dim),
                                           stand_in(shape.kv_len, dv), causal, scale);
  return checked_choice(b, like, shape.head_dim);
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
    case kBackendEfficient:
      // The CUTLASS backward never reads out's row stride: it assumes the
      // (B, L, H, D)-dense memory its own forward returns (o_strideM() =
      // num_heads * head_dim in kernel_backward.h) when the f16/bf16 kernels
      // compute delta = rowsum(dO * O). A (B, H, L, D)-contiguous `out` was
      // read at the wrong rows and past its end: NaN or wrong dq/dk (dv, which
      // needs no delta, stayed right).
      return aten::efficient_cuda_backward(seq_major(grad_out), q, k, v, Tensor(), seq_major(out),
                                           efficient_lse_padded(lse), seed, offset, causal,
                                           cfg.scale);
    default:
      return aten::cudnn_cuda_backward(aten::contiguous(grad_out), q, k, v, aten::contiguous(out),
                                       aten::contiguous(torch::stable::unsqueeze(lse, -1)), seed,
                                       offset, Lq, Lk, causal, cfg.scale);
  }
}

}  // namespace cplib::ring
