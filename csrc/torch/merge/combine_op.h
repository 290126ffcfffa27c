// The one-pass combine of partial results (cplib/combine.h) for tensors: the
// ring's partial outputs weighted by their lse, or partial gradients summed.
#pragma once

#include <vector>

#include "common/stable.h"

namespace cplib {

// One partial result: rows [row_offset, row_offset + data.size(2)) of the
// combined (B, H, L, D) tensor; `lse` (B, H, rows) in the accumulator dtype,
// or undefined in a plain sum.
struct CombinePart {
  Tensor data;
  Tensor lse;
  int64_t row_offset = 0;
};

// Writes the combination of `parts` into `out` (any of float32, bfloat16,
// float16, or float64 with float64 parts) and, weighted (every part has an
// lse), the combined lse into `lse`, on the tensors' device. `out` may be
// one of the parts when that part covers every row with the same strides
// and dtype (an accumulator folded again); `lse` must be a tensor of its
// own. At most CPLIB_COMBINE_MAX_PARTS parts.
void combine_partials(Tensor& out, Tensor* lse, const std::vector<CombinePart>& parts);

}  // namespace cplib
