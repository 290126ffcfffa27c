// The current CUDA stream, from the stable C shim. Only CUDA builds of torch
// export it, and its declaration is behind USE_CUDA; CPU builds of cplib
// leave this file empty.
#ifdef CPLIB_WITH_CUDA
#define USE_CUDA 1
#include <torch/csrc/inductor/aoti_torch/c/shim.h>

#include "common/c_core.h"

namespace cplib {

void* current_cuda_stream(const Tensor& t) {
  void* stream = nullptr;
  check_dispatch(aoti_torch_get_current_cuda_stream(t.get_device_index(), &stream),
                 "current CUDA stream", "");
  return stream;
}

}  // namespace cplib
#endif
