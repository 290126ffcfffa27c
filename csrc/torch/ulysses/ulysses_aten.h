// The ATen ops the Ulysses exchange needs that torch's stable ops header lacks.
#pragma once

#include <vector>

#include "common/stable.h"

namespace cplib::ulysses {

Tensor permuted(const Tensor& x, const std::vector<int64_t>& dims);
Tensor expand(const Tensor& x, const std::vector<int64_t>& sizes);

}  // namespace cplib::ulysses
