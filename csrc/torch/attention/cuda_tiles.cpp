#include "attention/cuda_tiles.h"

#include <limits>

#include "common/aten.h"

namespace cplib::attention {
namespace {

// The efficient kernel pads its lse rows to a multiple of 32.
constexpr int64_t kEfficientLseAlign = 32;

}  // namespace

Tensor philox_placeholder(const Tensor& like) {
  return aten::empty({}, aten::opts_of(like).dtype_(ScalarType::Long));
}

Tensor seq_major(const Tensor& t) {
  return torch::stable::transpose(aten::contiguous(torch::stable::transpose(t, 1, 2)), 1, 2);
}

Tensor efficient_lse_padded(const Tensor& lse) {
  const int64_t lq = lse.size(2);
  const int64_t padded = (lq + kEfficientLseAlign - 1) / kEfficientLseAlign * kEfficientLseAlign;
  Tensor out = aten::full({lse.size(0), lse.size(1), padded},
                          std::numeric_limits<double>::infinity(),
                          aten::opts_of(lse).dtype_(ScalarType::Float));
  aten::copy_(aten::narrow(out, 2, 0, lq), lse);
  return out;
}

}  // namespace cplib::attention
