// at::ScalarType -> cplib_dtype, and C status -> exception.
#pragma once

#include <ATen/ATen.h>

#include "cplib/types.h"

namespace cplib {

inline cplib_dtype to_cplib_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return CPLIB_F32;
    case at::kDouble: return CPLIB_F64;
    case at::kBFloat16: return CPLIB_BF16;
    case at::kHalf: return CPLIB_F16;
    default: TORCH_CHECK_VALUE(false, "cplib: unsupported dtype ", t,
                               " (expected float32, float64, bfloat16 or float16)");
  }
}

inline void check_status(int status, const char* what) {
  TORCH_CHECK(status == CPLIB_OK, "cplib: ", what, " failed: ", cplib_status_str(status));
}

}  // namespace cplib
