#include "cplib/types.h"

const char* cplib_status_str(int status) {
  switch (status) {
    case CPLIB_OK: return "ok";
    case CPLIB_EINVAL: return "invalid argument";
    case CPLIB_ELAUNCH: return "kernel launch failed";
    case CPLIB_ENOMEM: return "out of host memory";
    default: return "unknown cplib status";
  }
}
