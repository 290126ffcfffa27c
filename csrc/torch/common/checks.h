// Argument checks shared by the ops; all raise ValueError before any communication.
#pragma once

#include <ATen/ATen.h>

namespace cplib {

// Normalises a possibly negative dim, or raises ValueError naming it.
inline int64_t checked_dim(int64_t dim, int64_t ndim, const char* what) {
  TORCH_CHECK_VALUE(ndim > 0, "cplib: ", what, " needs a tensor with at least one dimension");
  TORCH_CHECK_VALUE(dim >= -ndim && dim < ndim, "cplib: ", what, "=", dim,
                    " is out of range for a tensor with ", ndim, " dimensions (expected in [",
                    -ndim, ", ", ndim - 1, "])");
  return dim < 0 ? dim + ndim : dim;
}

}  // namespace cplib
