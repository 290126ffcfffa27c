#include "common/errors.h"

namespace cplib {

const char* python_class(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::value: return "ValueError";
    case ErrorKind::not_implemented: return "NotImplementedError";
    case ErrorKind::type: return "TypeError";
    case ErrorKind::index: return "IndexError";
    default: return "RuntimeError";
  }
}

Error::Error(ErrorKind kind, const std::string& message)
    : std::runtime_error(std::string(python_class(kind)) + ": " + message),
      kind_(kind),
      message_(message) {}

}  // namespace cplib
