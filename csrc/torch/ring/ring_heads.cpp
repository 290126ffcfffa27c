#include "ring/ring_heads.h"

#include <algorithm>

namespace cplib::ring {

HeadExpander::HeadExpander(int64_t groups, const at::Tensor& like, int64_t max_len)
    : groups_(groups) {
  const int64_t rows = std::max<int64_t>(max_len, like.size(2));
  if (groups_ > 1)
    storage_ = at::empty({like.size(0) * like.size(1) * rows * like.size(3) * groups_},
                         like.options());
}

at::Tensor HeadExpander::operator()(const at::Tensor& x) {
  if (groups_ == 1) return x;
  const int64_t B = x.size(0), H = x.size(1), L = x.size(2), D = x.size(3);
  at::Tensor dst = storage_.narrow(0, 0, x.numel() * groups_).view({B, H, groups_, L, D});
  dst.copy_(x.unsqueeze(2).expand({B, H, groups_, L, D}));
  return dst.view({B, H * groups_, L, D});
}

void reduce_heads_into(at::Tensor acc, const at::Tensor& g, int64_t groups, bool accumulate) {
  if (groups == 1) {
    if (accumulate)
      acc.add_(g);
    else
      acc.copy_(g);
    return;
  }
  const int64_t B = acc.size(0), H = acc.size(1), L = acc.size(2), D = acc.size(3);
  at::Tensor grouped = g.reshape({B, H, groups, L, D});
  if (accumulate)
    acc.add_(grouped.sum(2, /*keepdim=*/false, acc.scalar_type()));
  else
    at::sum_out(acc, grouped, {2}, /*keepdim=*/false, acc.scalar_type());
}

}  // namespace cplib::ring
