// CUDA combine of partial results over rows; see cplib/combine.h.
// A row is handled by a group of L lanes (L = the row's 8-element vectors,
// rounded up to a power of two, at most 32), so a warp holds 32 / L rows (2
// at head dim 128): each lane computes its row's weights from the parts' lse
// (the same few values for the whole group, one cached load each), then
// loads its 8 elements of every part (128-bit loads in half precision, two
// in fp32) before it stores any, and writes them once in the output dtype.
// Index arithmetic is 32-bit whenever every offset fits. Rows or pointers
// that are not 16-byte aligned, or a head dim that is no multiple of 8, take
// the same kernel one element per lane.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cplib/combine.h"

namespace {

constexpr int kThreads = 256;
constexpr int kMaxParts = CPLIB_COMBINE_MAX_PARTS;

template <typename T>
struct Vec;  // VEC elements of T loaded at once, widened to Acc
template <>
struct Vec<float> {
  __device__ static void load8(const float* p, float* out) {
    const float4 a = reinterpret_cast<const float4*>(p)[0];
    const float4 b = reinterpret_cast<const float4*>(p)[1];
    out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
    out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
  }
  __device__ static void store8(float* p, const float* v) {
    reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
  }
  __device__ static float load1(const float* p) { return *p; }
  __device__ static void store1(float* p, float v) { *p = v; }
};
template <>
struct Vec<__nv_bfloat16> {
  __device__ static void load8(const __nv_bfloat16* p, float* out) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(h[i]);
      out[2 * i] = f.x, out[2 * i + 1] = f.y;
    }
  }
  __device__ static void store8(__nv_bfloat16* p, const float* v) {
    uint4 raw;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    *reinterpret_cast<uint4*>(p) = raw;
  }
  __device__ static float load1(const __nv_bfloat16* p) { return __bfloat162float(*p); }
  __device__ static void store1(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
};
template <>
struct Vec<__half> {
  __device__ static void load8(const __half* p, float* out) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const __half2* h = reinterpret_cast<const __half2*>(&raw);
    for (int i = 0; i < 4; ++i) {
      const float2 f = __half22float2(h[i]);
      out[2 * i] = f.x, out[2 * i + 1] = f.y;
    }
  }
  __device__ static void store8(__half* p, const float* v) {
    uint4 raw;
    __half2* h = reinterpret_cast<__half2*>(&raw);
    for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(v[2 * i], v[2 * i + 1]);
    *reinterpret_cast<uint4*>(p) = raw;
  }
  __device__ static float load1(const __half* p) { return __half2float(*p); }
  __device__ static void store1(__half* p, float v) { *p = __float2half_rn(v); }
};
template <>
struct Vec<double> {
  __device__ static double load1(const double* p) { return *p; }
  __device__ static void store1(double* p, double v) { *p = v; }
};

// Row r's weights, one per part (0 where a part does not cover the row or
// saw no key there), and its combined lse (-inf where no part saw a key).
template <typename Acc, typename I>
__device__ Acc row_weights(const cplib_combine_params& p, I b, I h, I r, Acc* w) {
  Acc m = -INFINITY;
#pragma unroll
  for (int j = 0; j < kMaxParts; ++j) {
    w[j] = -INFINITY;
    if (j >= p.nparts) continue;
    const cplib_combine_part& q = p.parts[j];
    const I local = r - static_cast<I>(q.row_offset);
    if (local < 0 || local >= static_cast<I>(q.rows)) continue;
    w[j] =
        !p.weighted
            ? Acc(0)
            : static_cast<const Acc*>(
                  q.lse)[b * static_cast<I>(q.lse_stride[0]) + h * static_cast<I>(q.lse_stride[1]) +
                         local * static_cast<I>(q.lse_stride[2])];
    m = w[j] > m ? w[j] : m;
  }
  Acc lse = -INFINITY;
  if (m != -INFINITY) {
    Acc s = 0;
#pragma unroll
    for (int j = 0; j < kMaxParts; ++j) s += j < p.nparts ? exp(w[j] - m) : Acc(0);
    lse = m + log(s);
  }
#pragma unroll
  for (int j = 0; j < kMaxParts; ++j)
    w[j] = w[j] == -INFINITY ? Acc(0) : p.weighted ? exp(w[j] - lse) : Acc(1);
  return lse;
}

// Acc: the accumulator type; Part: the parts' other dtype (parts of the
// accumulator dtype are read as Acc); Out: the output's; V: elements per
// lane (8 or 1); I: the index type.
template <typename Acc, typename Part, typename Out, int V, typename I>
__global__ void __launch_bounds__(kThreads) combine_kernel(cplib_combine_params p, int lanes) {
  const I rows_per_block = kThreads / lanes;
  const I row_id = static_cast<I>(blockIdx.x) * rows_per_block + threadIdx.x / lanes;
  const int lane = threadIdx.x % lanes;
  if (row_id >= static_cast<I>(p.batch * p.heads * p.rows)) return;
  const I r = row_id % static_cast<I>(p.rows);
  const I bh = row_id / static_cast<I>(p.rows);
  const I h = bh % static_cast<I>(p.heads), b = bh / static_cast<I>(p.heads);

  // The weights: every lane of the row computes them (a broadcast load each).
  Acc w[kMaxParts];
  const Acc lse = row_weights<Acc, I>(p, b, h, r, w);
  if (p.weighted && lane == 0) {
    static_cast<Acc*>(
        p.lse)[b * static_cast<I>(p.lse_stride[0]) + h * static_cast<I>(p.lse_stride[1]) +
               r * static_cast<I>(p.lse_stride[2])] = lse;
  }

  Out* out = static_cast<Out*>(p.out) + b * static_cast<I>(p.out_stride[0]) +
             h * static_cast<I>(p.out_stride[1]) + r * static_cast<I>(p.out_stride[2]);
  const I cols = static_cast<I>(p.dim) / V;
  for (I col = lane; col < cols; col += lanes) {
    // Every part's elements first, then one store: the loads are all in
    // flight before the lane waits on any of them.
    Acc x[kMaxParts][V];
#pragma unroll
    for (int j = 0; j < kMaxParts; ++j) {
      if (w[j] == Acc(0)) continue;  // not covering, or saw no key: not read
      const cplib_combine_part& q = p.parts[j];
      const I at = b * static_cast<I>(q.stride[0]) + h * static_cast<I>(q.stride[1]) +
                   (r - static_cast<I>(q.row_offset)) * static_cast<I>(q.stride[2]) +
                   col * V * static_cast<I>(q.stride[3]);
      const bool acc_typed = q.dtype == p.acc_dtype;
      if constexpr (V == 8) {
        if (acc_typed)
          Vec<Acc>::load8(static_cast<const Acc*>(q.data) + at, x[j]);
        else
          Vec<Part>::load8(static_cast<const Part*>(q.data) + at, x[j]);
      } else {
        x[j][0] = acc_typed
                      ? Vec<Acc>::load1(static_cast<const Acc*>(q.data) + at)
                      : static_cast<Acc>(Vec<Part>::load1(static_cast<const Part*>(q.data) + at));
      }
    }
    Acc sum[V];
#pragma unroll
    for (int e = 0; e < V; ++e) sum[e] = 0;
#pragma unroll
    for (int j = 0; j < kMaxParts; ++j) {
      if (w[j] == Acc(0)) continue;
#pragma unroll
      for (int e = 0; e < V; ++e) sum[e] += w[j] * x[j][e];
    }
    Out* o = out + col * V * static_cast<I>(p.out_stride[3]);
    if constexpr (V == 8)
      Vec<Out>::store8(o, sum);
    else
      Vec<Out>::store1(o, sum[0]);
  }
}

// Whether every offset of a tensor of `sizes` and `strides` fits in 32 bits.
bool fits32(int64_t b, int64_t h, int64_t r, int64_t d, const int64_t* st) {
  const int64_t last = (b - 1) * st[0] + (h - 1) * st[1] + (r - 1) * st[2] + (d - 1) * st[3];
  return last < (int64_t{1} << 31) - 1;
}

bool aligned16(const void* ptr, const int64_t* st, int64_t elem) {
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && st[3] == 1 && (st[0] * elem) % 16 == 0 &&
         (st[1] * elem) % 16 == 0 && (st[2] * elem) % 16 == 0;
}

int64_t elem_size(cplib_dtype t) { return t == CPLIB_F64 ? 8 : t == CPLIB_F32 ? 4 : 2; }

template <typename Acc, typename Part, typename Out>
int launch(const cplib_combine_params* p, cudaStream_t stream) {
  const int64_t rows = p->batch * p->heads * p->rows;
  if (rows == 0 || p->dim == 0) return CPLIB_OK;
  bool vec = !std::is_same<Acc, double>::value && p->dim % 8 == 0 &&
             aligned16(p->out, p->out_stride, elem_size(p->out_dtype));
  bool small = fits32(p->batch, p->heads, p->rows, p->dim, p->out_stride);
  for (int j = 0; j < p->nparts; ++j) {
    const cplib_combine_part& q = p->parts[j];
    vec = vec && aligned16(q.data, q.stride, elem_size(q.dtype));
    small = small && fits32(p->batch, p->heads, q.rows > 0 ? q.rows : 1, p->dim, q.stride);
  }
  small = small && rows < (int64_t{1} << 31) - 1;
  const int64_t cols = vec ? p->dim / 8 : p->dim;
  int lanes = 1;
  while (lanes < cols && lanes < 32) lanes *= 2;
  const int64_t blocks = (rows + kThreads / lanes - 1) / (kThreads / lanes);
  const dim3 grid(static_cast<unsigned>(blocks));
  if constexpr (std::is_same<Acc, double>::value) {
    if (small)
      combine_kernel<Acc, Part, Out, 1, int32_t><<<grid, kThreads, 0, stream>>>(*p, lanes);
    else
      combine_kernel<Acc, Part, Out, 1, int64_t><<<grid, kThreads, 0, stream>>>(*p, lanes);
  } else if (vec && small) {
    combine_kernel<Acc, Part, Out, 8, int32_t><<<grid, kThreads, 0, stream>>>(*p, lanes);
  } else if (vec) {
    combine_kernel<Acc, Part, Out, 8, int64_t><<<grid, kThreads, 0, stream>>>(*p, lanes);
  } else if (small) {
    combine_kernel<Acc, Part, Out, 1, int32_t><<<grid, kThreads, 0, stream>>>(*p, lanes);
  } else {
    combine_kernel<Acc, Part, Out, 1, int64_t><<<grid, kThreads, 0, stream>>>(*p, lanes);
  }
  return cudaGetLastError() == cudaSuccess ? CPLIB_OK : CPLIB_ELAUNCH;
}

// The parts' dtype besides the accumulator's (the accumulator's when none).
cplib_dtype part_dtype(const cplib_combine_params* p) {
  for (int j = 0; j < p->nparts; ++j)
    if (p->parts[j].dtype != p->acc_dtype) return p->parts[j].dtype;
  return p->out_dtype;
}

template <typename Part>
int launch_out(const cplib_combine_params* p, cudaStream_t s) {
  switch (p->out_dtype) {
    case CPLIB_F32: return launch<float, Part, float>(p, s);
    case CPLIB_BF16: return launch<float, Part, __nv_bfloat16>(p, s);
    case CPLIB_F16: return launch<float, Part, __half>(p, s);
    default: return CPLIB_EINVAL;
  }
}

}  // namespace

extern "C" int cplib_combine_cuda(const cplib_combine_params* p, void* stream) {
  const int status = cplib_combine_check(p);
  if (status != CPLIB_OK) return status;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (p->acc_dtype == CPLIB_F64) return launch<double, double, double>(p, s);
  switch (part_dtype(p)) {
    case CPLIB_F32: return launch_out<float>(p, s);
    case CPLIB_BF16: return launch_out<__nv_bfloat16>(p, s);
    case CPLIB_F16: return launch_out<__half>(p, s);
    default: return CPLIB_EINVAL;
  }
}
