// Block attention on CUDA with an explicit mask (the partial tiles of
// windows and documents): the memory-efficient kernel, the mask as its
// attention bias. Why not flash's varlen/window entry points: flash takes one
// window per call, aligned to each sequence's bottom-right corner, so a tile
// that spans several documents (each with its own offset between query and
// key positions) would need one call per document; the bias expresses any
// tile in one call. Rows the mask hides entirely are fixed by the caller
// (out 0, lse -inf), whatever the kernel returns for them.
// Compiled into every build; the CPU build's guard (ring/cuda_glue_probe.cpp)
// runs these functions on meta tensors.

#include "attention/block.h"
#include "attention/cuda_tiles.h"
#include "attention/kernels.h"
#include "common/aten.h"

namespace cplib::attention {
namespace {

// The efficient kernel needs the bias rows 16-element aligned.
constexpr int64_t kBiasAlign = 16;

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// (Lq, Lk) -> (B, H, Lq, Lk) broadcast view over 16-aligned rows.
Tensor as_bias(const Tensor& mask, const Tensor& q, const Tensor& k) {
  const int64_t lq = mask.size(0), lk = mask.size(1);
  Tensor aligned = aten::empty({lq, round_up(lk, kBiasAlign)}, aten::opts_of(mask));
  aten::copy_(aten::narrow(aligned, 1, 0, lk), mask);
  return aten::expand(aten::narrow(aligned, 1, 0, lk), {q.size(0), q.size(1), lq, k.size(2)});
}

}  // namespace

BlockResult block_forward_cuda_masked(const BlockConfig& cfg, const Tensor& q, const Tensor& k,
                                      const Tensor& v, const Tensor& mask) {
  auto [out, lse] = efficient_cuda(q, k, v, as_bias(mask, q, k), /*causal=*/false, cfg.scale);
  return {out, aten::narrow(lse, 2, 0, q.size(2))};
}

std::tuple<Tensor, Tensor, Tensor> block_backward_cuda_masked(
    const BlockConfig& cfg, const Tensor& grad_out, const Tensor& q, const Tensor& k,
    const Tensor& v, const Tensor& out, const Tensor& lse, const Tensor& mask) {
  const Tensor seed = philox_placeholder(q), offset = philox_placeholder(q);
  return efficient_cuda_backward(seq_major(grad_out), q, k, v, as_bias(mask, q, k), seq_major(out),
                                 efficient_lse_padded(lse), seed, offset,
                                 /*is_causal=*/false, cfg.scale);
}

}  // namespace cplib::attention
