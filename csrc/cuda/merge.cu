// CUDA fused merge of partial attention results; see cplib/merge.h.
// A row is handled by a group of L lanes (L = the row's 8-element vectors,
// rounded up to a power of two, at most 32), so a warp holds 32 / L rows (2
// at head dim 128): every lane of a group reads the row's two lse values
// (one cached load each) and computes the weight itself, loads its 8
// accumulator elements and its 8 block elements (128-bit loads: two in
// fp32, one in half precision) before it stores, and the group's first lane
// writes the new lse once every lane of the group has read the old one.
// Index arithmetic is 32-bit whenever every offset fits; rows or pointers
// that are not 16-byte aligned, a head dim that is no multiple of 8, or
// fp64 take the same kernel one element per lane.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cplib/merge.h"

namespace {

constexpr int kThreads = 256;

template <typename T>
struct Vec;  // 8 elements of T loaded or stored at once, as float
template <>
struct Vec<float> {
  __device__ static void load8(const float* __restrict__ p, float* out) {
    const float4 a = reinterpret_cast<const float4*>(p)[0];
    const float4 b = reinterpret_cast<const float4*>(p)[1];
    out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
    out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
  }
  __device__ static void store8(float* __restrict__ p, const float* v) {
    reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
  }
};
template <>
struct Vec<__nv_bfloat16> {
  __device__ static void load8(const __nv_bfloat16* __restrict__ p, float* out) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(h[i]);
      out[2 * i] = f.x, out[2 * i + 1] = f.y;
    }
  }
};
template <>
struct Vec<__half> {
  __device__ static void load8(const __half* __restrict__ p, float* out) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const __half2* h = reinterpret_cast<const __half2*>(&raw);
    for (int i = 0; i < 4; ++i) {
      const float2 f = __half22float2(h[i]);
      out[2 * i] = f.x, out[2 * i + 1] = f.y;
    }
  }
};

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

// V: elements per lane (8: vectorised; 1); I: the index type.
template <typename Acc, typename Blk, int V, typename I>
__global__ void __launch_bounds__(kThreads) merge_kernel(cplib_merge_params p, int lanes) {
  const I row_id = static_cast<I>(blockIdx.x) * (kThreads / lanes) + threadIdx.x / lanes;
  const int lane = threadIdx.x % lanes;
  if (row_id >= static_cast<I>(p.batch * p.heads * p.rows)) return;
  const I r = row_id % static_cast<I>(p.rows);
  const I bh = row_id / static_cast<I>(p.rows);
  const I h = bh % static_cast<I>(p.heads), b = bh / static_cast<I>(p.heads);
  const I row = r + static_cast<I>(p.row_offset);

  const Acc c = static_cast<const Acc*>(
      p.blk_lse)[b * static_cast<I>(p.blk_lse_stride[0]) + h * static_cast<I>(p.blk_lse_stride[1]) +
                 r * static_cast<I>(p.blk_lse_stride[2])];
  if (isinf(c) && c < 0) return;  // the block saw no key here: nothing to merge (the whole group)
  Acc* __restrict__ lse = static_cast<Acc*>(p.lse) + b * static_cast<I>(p.lse_stride[0]) +
                          h * static_cast<I>(p.lse_stride[1]) +
                          row * static_cast<I>(p.lse_stride[2]);
  const Acc a = *lse;
  const bool empty = isinf(a) && a < 0;
  const Acc w = empty ? Acc(1) : Acc(1) / (Acc(1) + exp(a - c));

  Acc* __restrict__ out = static_cast<Acc*>(p.out) + b * static_cast<I>(p.out_stride[0]) +
                          h * static_cast<I>(p.out_stride[1]) +
                          row * static_cast<I>(p.out_stride[2]);
  const Blk* __restrict__ blk = static_cast<const Blk*>(p.blk_out) +
                                b * static_cast<I>(p.blk_out_stride[0]) +
                                h * static_cast<I>(p.blk_out_stride[1]) +
                                r * static_cast<I>(p.blk_out_stride[2]);
  const I cols = static_cast<I>(p.dim) / V;
  for (I col = lane; col < cols; col += lanes) {
    if constexpr (V == 8) {
      float o[8], x[8];  // both loads in flight before the store
      Vec<Acc>::load8(out + col * 8, o);
      Vec<Blk>::load8(blk + col * 8, x);
#pragma unroll
      for (int e = 0; e < 8; ++e) o[e] += w * (x[e] - o[e]);
      Vec<Acc>::store8(out + col * 8, o);
    } else {
      const I os = static_cast<I>(p.out_stride[3]), bs = static_cast<I>(p.blk_out_stride[3]);
      const Acc o = out[col * os];
      const Acc x = widen<Acc>(blk[col * bs]);
      out[col * os] = o + w * (x - o);
    }
  }
  // Every lane of the group has read the old lse before the new one lands
  // (the group's lanes agree on every early return above).
  const unsigned group = lanes == 32 ? 0xffffffffu
                                     : ((1u << lanes) - 1u) << ((threadIdx.x % 32) & ~(lanes - 1));
  __syncwarp(group);
  if (lane == 0) *lse = empty ? c : (a > c ? a : c) + log1p(exp(-fabs(a - c)));
}

bool fits32(int64_t b, int64_t h, int64_t r, int64_t d, const int64_t* st) {
  const int64_t last = (b - 1) * st[0] + (h - 1) * st[1] + (r - 1) * st[2] + (d - 1) * st[3];
  return last < (int64_t{1} << 31) - 1;
}

bool aligned16(const void* ptr, const int64_t* st, int64_t elem) {
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && st[3] == 1 && (st[0] * elem) % 16 == 0 &&
         (st[1] * elem) % 16 == 0 && (st[2] * elem) % 16 == 0;
}

template <typename Acc, typename Blk>
int launch(const cplib_merge_params* p, cudaStream_t stream) {
  const int64_t n = p->batch * p->heads * p->rows;
  if (n == 0) return CPLIB_OK;
  const bool vec = std::is_same<Acc, float>::value && p->dim % 8 == 0 &&
                   aligned16(p->out, p->out_stride, sizeof(Acc)) &&
                   aligned16(p->blk_out, p->blk_out_stride, sizeof(Blk));
  const int64_t rows = p->row_offset + p->rows;
  const bool small = n < (int64_t{1} << 31) - 1 &&
                     fits32(p->batch, p->heads, rows, p->dim, p->out_stride) &&
                     fits32(p->batch, p->heads, p->rows, p->dim, p->blk_out_stride) &&
                     fits32(p->batch, p->heads, rows, 1, p->lse_stride) &&
                     fits32(p->batch, p->heads, p->rows, 1, p->blk_lse_stride);
  const int64_t cols = vec ? p->dim / 8 : p->dim;
  int lanes = 1;
  while (lanes < cols && lanes < 32) lanes *= 2;
  const int64_t per_block = kThreads / lanes;
  const dim3 grid(static_cast<unsigned>((n + per_block - 1) / per_block));
  if constexpr (std::is_same<Acc, float>::value) {
    if (vec && small)
      merge_kernel<Acc, Blk, 8, int32_t><<<grid, kThreads, 0, stream>>>(*p, lanes);
    else if (vec)
      merge_kernel<Acc, Blk, 8, int64_t><<<grid, kThreads, 0, stream>>>(*p, lanes);
    else if (small)
      merge_kernel<Acc, Blk, 1, int32_t><<<grid, kThreads, 0, stream>>>(*p, lanes);
    else
      merge_kernel<Acc, Blk, 1, int64_t><<<grid, kThreads, 0, stream>>>(*p, lanes);
  } else if (small) {
    merge_kernel<Acc, Blk, 1, int32_t><<<grid, kThreads, 0, stream>>>(*p, lanes);
  } else {
    merge_kernel<Acc, Blk, 1, int64_t><<<grid, kThreads, 0, stream>>>(*p, lanes);
  }
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
