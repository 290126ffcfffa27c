// From the stable ABI's types to the C core's: dtypes, status codes and the
// current CUDA stream (the C and CUDA C kernels take pointers, sizes and a
// stream, nothing of torch's).
#pragma once

#include "common/stable.h"
#include "cplib/types.h"

namespace cplib {

// ValueError naming any other dtype.
cplib_dtype to_cplib_dtype(ScalarType t);
// RuntimeError naming `what` unless `status` is CPLIB_OK.
void check_status(int status, const char* what);
#ifdef CPLIB_WITH_CUDA
// The current CUDA stream of `t`'s device (a cudaStream_t).
void* current_cuda_stream(const Tensor& t);
#endif

}  // namespace cplib
