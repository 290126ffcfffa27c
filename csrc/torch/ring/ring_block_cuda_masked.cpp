// Block attention on CUDA with an explicit mask (the partial tiles of
// windows and documents): the memory-efficient kernel, the mask as its
// attention bias. Why not flash's varlen/window entry points: flash takes one
// window per call, aligned to each sequence's bottom-right corner, so a tile
// that spans several documents (each with its own offset between query and
// key positions) would need one call per document; the bias expresses any
// tile in one call. Rows the mask hides entirely are fixed by the caller
// (out 0, lse -inf), whatever the kernel returns for them.
// NOTE: written without a GPU to run it on; the CPU path is the tested one.
#ifdef CPLIB_WITH_CUDA

#include <ATen/ops/_scaled_dot_product_efficient_attention.h>
#include <ATen/ops/_scaled_dot_product_efficient_attention_backward.h>

#include <limits>

#include "ring/ring_block.h"

namespace cplib::ring {
namespace {

// The efficient kernel needs the bias rows 16-element aligned, and pads its
// lse rows to a multiple of 32.
constexpr int64_t kBiasAlign = 16;
constexpr int64_t kLseAlign = 32;

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// (Lq, Lk) -> (B, H, Lq, Lk) broadcast view over 16-aligned rows.
at::Tensor as_bias(const at::Tensor& mask, const at::Tensor& q, const at::Tensor& k) {
  const int64_t lq = mask.size(0), lk = mask.size(1);
  at::Tensor aligned = at::empty({lq, round_up(lk, kBiasAlign)}, mask.options());
  aligned.narrow(1, 0, lk).copy_(mask);
  return aligned.narrow(1, 0, lk).expand({q.size(0), q.size(1), lq, k.size(2)});
}

// A (B, H, L, D) view whose memory is (B, L, H, D)-dense: the efficient
// backward assumes that layout for out and grad_out (see ring_block_cuda.cpp).
at::Tensor seq_major(const at::Tensor& t) { return t.transpose(1, 2).contiguous().transpose(1, 2); }

}  // namespace

BlockResult block_forward_cuda_masked(const Config& cfg, const at::Tensor& q, const at::Tensor& k,
                                      const at::Tensor& v, const at::Tensor& mask) {
  auto r = at::_scaled_dot_product_efficient_attention(q, k, v, as_bias(mask, q, k),
                                                       /*compute_log_sumexp=*/true, 0.0,
                                                       /*is_causal=*/false, cfg.scale);
  return {std::get<0>(r), std::get<1>(r).narrow(2, 0, q.size(2))};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> block_backward_cuda_masked(
    const Config& cfg, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& mask) {
  const int64_t lq = q.size(2);
  // Padded as the forward pads it (+inf: those rows get probability 0).
  at::Tensor lse_padded = at::full({lse.size(0), lse.size(1), round_up(lq, kLseAlign)},
                                   std::numeric_limits<double>::infinity(),
                                   lse.options().dtype(at::kFloat));
  lse_padded.narrow(2, 0, lq).copy_(lse);
  const at::Tensor seed = at::empty({}, q.options().dtype(at::kLong));
  const at::Tensor offset = at::empty({}, q.options().dtype(at::kLong));
  auto r = at::_scaled_dot_product_efficient_attention_backward(
      seq_major(grad_out), q, k, v, as_bias(mask, q, k), seq_major(out), lse_padded, seed, offset,
      0.0, {true, true, true, false}, /*is_causal=*/false, cfg.scale);
  return {std::get<0>(r), std::get<1>(r), std::get<2>(r)};
}

}  // namespace cplib::ring

#endif  // CPLIB_WITH_CUDA
