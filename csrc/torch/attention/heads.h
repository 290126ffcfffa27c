// K/V keep their Hkv heads (and travel with them in the ring); only the
// block kernels see them expanded to q's heads (GQA), and gradients are
// reduced back over each group of q heads before they are accumulated.
#pragma once

#include "common/stable.h"

// Internal to the extension (torch's stable types are hidden).
#pragma GCC visibility push(hidden)

namespace cplib::attention {

// Expands (B, Hkv, L, D) to (B, Hkv * groups, L, D) into a buffer allocated
// once for the largest block (`like` with up to `max_len` rows); with
// groups == 1 it returns its input.
class HeadExpander {
 public:
  HeadExpander(int64_t groups, const Tensor& like, int64_t max_len);
  Tensor operator()(const Tensor& x);

 private:
  int64_t groups_;
  Tensor storage_;  // flat, numel of `like` times groups
};

// acc (B, Hkv, L, D) = (or +=, with accumulate) the sum over each group of q
// heads of g (B, Hkv * groups, L, D), summing in acc's dtype.
void reduce_heads_into(const Tensor& acc, const Tensor& g, int64_t groups, bool accumulate);

}  // namespace cplib::attention

#pragma GCC visibility pop
