// What a rank does for one tp_convolution call: validated conv parameters and
// how its local input is extended along the shard dim. Built before any
// communication, so every bad argument raises here.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "common/stable.h"

namespace cplib {

struct TpConvPlan {
  int64_t dim = 0;                                 // shard dim of x (normalised)
  std::vector<int64_t> stride, padding, dilation;  // one entry per spatial dim
  std::vector<int64_t> conv_padding;               // padding handed to aten::convolution
  int64_t rank = 0, size = 1;
  // exchange == false: the local convolution is already the local output
  // (batch sharding, one rank, non-overlapping windows, 1-wide kernels).
  bool exchange = false;
  int64_t width = 0;                      // local input width along dim
  int64_t left = 0, right = 0;            // columns prepended / appended
  int64_t halo_left = 0, halo_right = 0;  // of which come from the neighbours
  int64_t send_left = 0, send_right = 0;  // columns sent to the left / right neighbour
  int64_t halo = 0;                       // dilation * (kernel - 1) along dim
  int64_t lh = 0, rh = 0;                 // halo columns a window needs left / right
  // left == right and the shard is at least a window wide: convolve x itself
  // with padding `left` and recompute only the border columns from small
  // [halo | edge] slabs (no copy of x). Otherwise convolve the extended copy.
  bool patched = false;

  std::vector<int64_t> extended_sizes(const Tensor& x) const;
};

// Raises ValueError / NotImplementedError naming the offending parameter.
TpConvPlan make_tp_conv_plan(const Tensor& x, const Tensor& w, const std::optional<Tensor>& b,
                             const std::vector<int64_t>& stride,
                             const std::vector<int64_t>& padding,
                             const std::vector<int64_t>& dilation, int64_t groups,
                             int64_t shard_dim, int64_t rank, int64_t size);

}  // namespace cplib
