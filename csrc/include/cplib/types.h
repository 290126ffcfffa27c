/* Plain C types shared by the CPU (C11) and CUDA cores. No torch here. */
#ifndef CPLIB_TYPES_H
#define CPLIB_TYPES_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Element types the kernels understand; the glue maps at::ScalarType onto these. */
typedef enum { CPLIB_F32 = 0, CPLIB_F64 = 1, CPLIB_BF16 = 2, CPLIB_F16 = 3 } cplib_dtype;

/* Status codes returned by every C entry point (0 = success). */
typedef enum {
  CPLIB_OK = 0,
  CPLIB_EINVAL = 1,  /* bad argument: shape, dtype or pointer */
  CPLIB_ELAUNCH = 2, /* the device refused the launch */
  CPLIB_ENOMEM = 3   /* host scratch memory could not be allocated */
} cplib_status;

const char* cplib_status_str(int status);

#ifdef __cplusplus
}
#endif
#endif
