#include "cplib/types.h"

const char* cplib_status_str(int status) {
  switch (status) {
    case CPLIB_OK: return "ok";
    case CPLIB_EINVAL: return "invalid argument";
    case CPLIB_ELAUNCH: return "kernel launch failed";
    default: return "unknown cplib status";
  }
}
