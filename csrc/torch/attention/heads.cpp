#include "attention/heads.h"

#include <algorithm>

#include "common/aten.h"

namespace cplib::attention {

HeadExpander::HeadExpander(int64_t groups, const Tensor& like, int64_t max_len) : groups_(groups) {
  const int64_t rows = std::max<int64_t>(max_len, like.size(2));
  if (groups_ > 1)
    storage_ = aten::empty({like.size(0) * like.size(1) * rows * like.size(3) * groups_},
                           aten::opts_of(like));
}

Tensor HeadExpander::operator()(const Tensor& x) {
  if (groups_ == 1) return x;
  const int64_t B = x.size(0), H = x.size(1), L = x.size(2), D = x.size(3);
  // Each k/v head repeated `groups_` times: a stride-0 view copied once.
  const Tensor repeated = aten::reinterpret(
      x, {B, H, groups_, L, D}, {x.stride(0), x.stride(1), 0, x.stride(2), x.stride(3)}, 0);
  aten::copy_(aten::carve(storage_, {B, H, groups_, L, D}, 0), repeated);
  return aten::carve(storage_, {B, H * groups_, L, D}, 0);
}

void reduce_heads_into(const Tensor& acc, const Tensor& g, int64_t groups, bool accumulate) {
  if (groups == 1) {
    if (accumulate)
      aten::add_(acc, g);
    else
      aten::copy_(acc, g);
    return;
  }
  const int64_t B = acc.size(0), H = acc.size(1), L = acc.size(2), D = acc.size(3);
  // g's heads split into (H, groups), whatever its strides.
  const Tensor grouped = aten::reinterpret(
      g, {B, H, groups, L, D},
      {g.stride(0), groups * g.stride(1), g.stride(1), g.stride(2), g.stride(3)}, 0);
  if (accumulate)
    aten::add_(acc, aten::sum_dim(grouped, 2, acc.scalar_type()));
  else
    aten::sum_dim_out(acc, grouped, 2, acc.scalar_type());
}

}  // namespace cplib::attention
