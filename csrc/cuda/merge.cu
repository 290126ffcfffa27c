// CUDA fused merge of partial attention results; see cplib/merge.h.
// One warp per (b, h, row): every lane reads the same two lse values and
// computes the weight itself (no shuffle), then lanes stride over dim.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cplib/merge.h"

namespace {

// Widen a block element to the accumulator type (half types go through float).
template <typename Acc, typename T>
__device__ __forceinline__ Acc widen(T v) {
  return static_cast<Acc>(v);
}
template <>
__device__ __forceinline__ float widen<float, __nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
__device__ __forceinline__ float widen<float, __half>(__half v) {
  return __half2float(v);
}

template <typename Acc, typename Blk>
__global__ void merge_kernel(cplib_merge_params p) {
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  const int64_t n = p.batch * p.heads * p.rows;
  if (warp >= n) return;
  const int64_t r = warp % p.rows;
  const int64_t h = (warp / p.rows) % p.heads;
  const int64_t b = warp / (p.rows * p.heads);

  Acc* lse = static_cast<Acc*>(p.lse) + b * p.lse_stride[0] + h * p.lse_stride[1] +
             (r + p.row_offset) * p.lse_stride[2];
  const Acc c = static_cast<const Acc*>(
      p.blk_lse)[b * p.blk_lse_stride[0] + h * p.blk_lse_stride[1] + r * p.blk_lse_stride[2]];
  if (isinf(c) && c < 0) return;
  const Acc a = *lse;
  Acc w;
  if (isinf(a) && a < 0) {
    w = Acc(1);
  } else {
    w = Acc(1) / (Acc(1) + exp(a - c));
  }
  Acc* out = static_cast<Acc*>(p.out) + b * p.out_stride[0] + h * p.out_stride[1] +
             (r + p.row_offset) * p.out_stride[2];
  const Blk* blk = static_cast<const Blk*>(p.blk_out) + b * p.blk_out_stride[0] +
                   h * p.blk_out_stride[1] + r * p.blk_out_stride[2];
  for (int64_t d = lane; d < p.dim; d += 32) {
    Acc o = out[d * p.out_stride[3]];
    Acc v = widen<Acc>(blk[d * p.blk_out_stride[3]]);
    out[d * p.out_stride[3]] = o + w * (v - o);
  }
  __syncwarp();
  if (lane == 0) {
    *lse = (isinf(a) && a < 0) ? c : (a > c ? a : c) + log1p(exp(-fabs(a - c)));
  }
}

template <typename Acc, typename Blk>
int launch(const cplib_merge_params* p, cudaStream_t stream) {
  const int64_t n = p->batch * p->heads * p->rows;
  if (n == 0) return CPLIB_OK;
  const int threads = 256;
  const int64_t blocks = (n * 32 + threads - 1) / threads;
  merge_kernel<Acc, Blk><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(*p);
  return cudaGetLastError() == cudaSuccess ? CPLIB_OK : CPLIB_ELAUNCH;
}

}  // namespace

extern "C" int cplib_merge_cuda(const cplib_merge_params* p, void* stream) {
  if (p == nullptr || p->out == nullptr || p->lse == nullptr || p->blk_out == nullptr ||
      p->blk_lse == nullptr)
    return CPLIB_EINVAL;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (p->acc_dtype == CPLIB_F64) {
    return p->blk_dtype == CPLIB_F64 ? launch<double, double>(p, s) : CPLIB_EINVAL;
  }
  if (p->acc_dtype != CPLIB_F32) return CPLIB_EINVAL;
  switch (p->blk_dtype) {
    case CPLIB_F32: return launch<float, float>(p, s);
    case CPLIB_BF16: return launch<float, __nv_bfloat16>(p, s);
    case CPLIB_F16: return launch<float, __half>(p, s);
    default: return CPLIB_EINVAL;
  }
}
