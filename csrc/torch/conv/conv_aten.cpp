#include "conv/conv_aten.h"

#include <torch/headeronly/util/HeaderOnlyArrayRef.h>

namespace cplib {
namespace {

std::vector<int64_t> no_output_padding(const std::vector<int64_t>& stride) {
  return std::vector<int64_t>(stride.size(), 0);
}

}  // namespace

Tensor convolution(const Tensor& x, const Tensor& w, const std::optional<Tensor>& b,
                   const std::vector<int64_t>& stride, const std::vector<int64_t>& padding,
                   const std::vector<int64_t>& dilation, int64_t groups) {
  auto s = call("aten::convolution", "", x, w, b, stride, padding, dilation, /*transposed=*/false,
                no_output_padding(stride), groups);
  return ret<Tensor>(s[0]);
}

ConvGrads convolution_backward(const Tensor& grad_out, const Tensor& x, const Tensor& w,
                               const std::vector<int64_t>& stride,
                               const std::vector<int64_t>& padding,
                               const std::vector<int64_t>& dilation, int64_t groups,
                               std::array<bool, 3> mask) {
  const std::optional<std::vector<int64_t>> bias_sizes =
      mask[2] ? std::optional<std::vector<int64_t>>(std::vector<int64_t>{w.size(0)}) : std::nullopt;
  // bool[3] travels as a list of bools (std::vector<bool> has no contiguous storage).
  const torch::headeronly::HeaderOnlyArrayRef<bool> output_mask(mask);
  auto s = call<3>("aten::convolution_backward", "", grad_out, x, w, bias_sizes, stride, padding,
                   dilation, /*transposed=*/false, no_output_padding(stride), groups, output_mask);
  return {ret<Tensor>(s[0]), ret<Tensor>(s[1]), ret<Tensor>(s[2])};
}

Tensor cat(const std::vector<Tensor>& tensors, int64_t dim) {
  auto s = call("aten::cat", "", tensors, dim);
  return ret<Tensor>(s[0]);
}

}  // namespace cplib
