// Dtype classes and dim normalisation shared by the op files (what ATen's
// isFloatingType / isIntegralType / maybe_wrap_dim gave on the old ABI).
#pragma once

#include <cstdint>

#include "common/stable.h"

namespace cplib {

// float64/32, the 16-bit floats and the 8- and 4-bit ones.
bool is_floating(ScalarType t);
// Signed and unsigned integers (bool excluded).
bool is_integer(ScalarType t);
// `dim` in [-ndim, ndim) made non-negative, or ValueError naming `what`.
int64_t checked_dim(int64_t dim, int64_t ndim, const char* what);

}  // namespace cplib
