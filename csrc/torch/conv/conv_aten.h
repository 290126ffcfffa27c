// The ATen ops tp_convolution calls, by name through the stable dispatcher.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "common/stable.h"

namespace cplib {

using ConvGrads = std::tuple<Tensor, Tensor, Tensor>;

// aten::convolution, not transposed (output_padding all zeros).
Tensor convolution(const Tensor& x, const Tensor& w, const std::optional<Tensor>& b,
                   const std::vector<int64_t>& stride, const std::vector<int64_t>& padding,
                   const std::vector<int64_t>& dilation, int64_t groups);
// aten::convolution_backward, not transposed; grad_bias (mask[2]) is w.size(0) wide.
ConvGrads convolution_backward(const Tensor& grad_out, const Tensor& x, const Tensor& w,
                               const std::vector<int64_t>& stride,
                               const std::vector<int64_t>& padding,
                               const std::vector<int64_t>& dilation, int64_t groups,
                               std::array<bool, 3> mask);
Tensor cat(const std::vector<Tensor>& tensors, int64_t dim);
// dst += src, in place (dst may be a view).

}  // namespace cplib
