// K/V travel packed in one flat buffer with Hkv heads; only the local block
// attention sees them expanded to q's heads (GQA), and gradients are reduced
// back over each group of q heads before they are accumulated.
#pragma once

#include <utility>

#include <ATen/ATen.h>

namespace cplib::ring {

// A fresh flat contiguous buffer holding k then v (their dtype).
at::Tensor pack_kv(const at::Tensor& k, const at::Tensor& v);

// (k, v) views of a packed buffer; k_sizes/v_sizes are the unexpanded shapes.
std::pair<at::Tensor, at::Tensor> unpack_kv(const at::Tensor& flat, at::IntArrayRef k_sizes,
                                            at::IntArrayRef v_sizes);

// Expands (B, Hkv, L, D) to (B, Hkv * groups, L, D) into a buffer allocated
// once for the largest block; with groups == 1 it returns its input.
class HeadExpander {
 public:
  HeadExpander(int64_t groups, const at::Tensor& like);
  at::Tensor operator()(const at::Tensor& x);

 private:
  int64_t groups_;
  at::Tensor storage_;  // flat, numel of `like` times groups
};

// acc (B, Hkv, L, D) += sum over each group of q heads of g (B, Hkv * groups, L, D),
// summing in acc's dtype.
void add_reduced_heads(at::Tensor acc, const at::Tensor& g, int64_t groups);

}  // namespace cplib::ring
