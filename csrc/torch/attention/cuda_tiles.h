// What the CUDA block kernels (block_cuda.cpp, block_cuda_masked.cpp)
// share: the placeholders and layouts ATen's CUDA attention backwards expect.
// No CUDA runtime call: compiled into every build, run on meta tensors by the
// guard (ring/cuda_glue_probe.cpp).
#pragma once

#include "common/stable.h"

// Internal to the extension (torch's stable types are hidden).
#pragma GCC visibility push(hidden)

namespace cplib::attention {

// A philox seed or offset for a backward that never drops out: a 0-d int64
// tensor on `like`'s device (the kernels read it only with dropout).
Tensor philox_placeholder(const Tensor& like);

// A (B, H, L, D) view of `t` whose memory is (B, L, H, D)-dense, the layout
// the efficient kernels' outputs have and their backward assumes for out and
// grad_out (see block_cuda.cpp).
Tensor seq_major(const Tensor& t);

// The lse rows (B, H, Lq) as the efficient backward reads them: float32 (the
// kernel's lse is float32 whatever the input dtype, and its backward reads
// it as float32), padded to a multiple of 32 rows as its forward pads them,
// with +inf (padding rows get probability 0).
Tensor efficient_lse_padded(const Tensor& lse);

}  // namespace cplib::attention

#pragma GCC visibility pop
