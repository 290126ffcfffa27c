#include "common/checks.h"

#include "common/format.h"

namespace cplib {

bool is_floating(ScalarType t) {
  switch (t) {
    case ScalarType::Double:
    case ScalarType::Float:
    case ScalarType::Half:
    case ScalarType::BFloat16:
    case ScalarType::Float8_e5m2:
    case ScalarType::Float8_e5m2fnuz:
    case ScalarType::Float8_e4m3fn:
    case ScalarType::Float8_e4m3fnuz:
    case ScalarType::Float8_e8m0fnu:
    case ScalarType::Float4_e2m1fn_x2: return true;
    default: return false;
  }
}

bool is_integer(ScalarType t) {
  switch (t) {
    case ScalarType::Byte:
    case ScalarType::Char:
    case ScalarType::Short:
    case ScalarType::Int:
    case ScalarType::Long:
    case ScalarType::UInt16:
    case ScalarType::UInt32:
    case ScalarType::UInt64: return true;
    default: return false;
  }
}

int64_t checked_dim(int64_t dim, int64_t ndim, const char* what) {
  CPLIB_CHECK_VALUE(ndim > 0, "cplib: ", what, " needs a tensor with at least one dimension");
  CPLIB_CHECK_VALUE(dim >= -ndim && dim < ndim, "cplib: ", what, "=", dim,
                    " is out of range for a tensor with ", ndim, " dimensions (expected in [",
                    -ndim, ", ", ndim - 1, "])");
  return dim < 0 ? dim + ndim : dim;
}

}  // namespace cplib
