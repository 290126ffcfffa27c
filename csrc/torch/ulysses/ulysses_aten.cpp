#include "ulysses/ulysses_aten.h"

namespace cplib::ulysses {

Tensor permuted(const Tensor& x, const std::vector<int64_t>& dims) {
  return ret<Tensor>(call("aten::permute", "", x, dims)[0]);
}

Tensor expand(const Tensor& x, const std::vector<int64_t>& sizes) {
  return ret<Tensor>(call("aten::expand", "", x, sizes, false)[0]);
}

}  // namespace cplib::ulysses
