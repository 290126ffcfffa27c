#include "common/c_core.h"

namespace cplib {

cplib_dtype to_cplib_dtype(ScalarType t) {
  switch (t) {
    case ScalarType::Float: return CPLIB_F32;
    case ScalarType::Double: return CPLIB_F64;
    case ScalarType::BFloat16: return CPLIB_BF16;
    case ScalarType::Half: return CPLIB_F16;
    default:
      raise(ErrorKind::value, str("cplib: unsupported dtype ", torch::headeronly::toString(t),
                                  " (expected float32, float64, bfloat16 or float16)"));
  }
}

void check_status(int status, const char* what) {
  CPLIB_CHECK(status == CPLIB_OK, "cplib: ", what, " failed: ", cplib_status_str(status));
}

}  // namespace cplib
