// CUDA halo packing; see cplib/halo.h. One thread per slab element (grid-
// stride loop); elements move as unsigned integers of the element's width.
#include <cuda_runtime.h>
#include <stdint.h>

#include "cplib/halo.h"

namespace {

struct Geometry {
  int ndim;
  int64_t shape[CPLIB_HALO_MAX_DIMS];    // slab shape (width along dim)
  int64_t strides[CPLIB_HALO_MAX_DIMS];  // tensor strides, in elements
  int64_t total;
};

template <typename T, bool ToDense>
__global__ void halo_kernel(Geometry g, T* tensor, T* dense) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < g.total;
       i += step) {
    int64_t rem = i, off = 0;
    for (int d = g.ndim - 1; d >= 0; --d) {
      off += (rem % g.shape[d]) * g.strides[d];
      rem /= g.shape[d];
    }
    if (ToDense)
      dense[i] = tensor[off];
    else
      tensor[off] = dense[i];
  }
}

bool valid(const cplib_halo_slab* s) {
  if (s == nullptr || s->ndim < 1 || s->ndim > CPLIB_HALO_MAX_DIMS) return false;
  if (s->dim < 0 || s->dim >= s->ndim || s->start < 0 || s->width < 0) return false;
  if (s->start + s->width > s->sizes[s->dim]) return false;
  for (int d = 0; d < s->ndim; ++d)
    if (s->sizes[d] < 0 || s->strides[d] < 0) return false;
  return true;
}

template <typename T, bool ToDense>
int launch(const Geometry& g, char* tensor, char* dense, cudaStream_t stream) {
  const int threads = 256;
  int64_t blocks = (g.total + threads - 1) / threads;
  if (blocks > 65535) blocks = 65535;  // the grid-stride loop covers the rest
  halo_kernel<T, ToDense><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
      g, reinterpret_cast<T*>(tensor), reinterpret_cast<T*>(dense));
  return cudaGetLastError() == cudaSuccess ? CPLIB_OK : CPLIB_ELAUNCH;
}

template <bool ToDense>
int halo_copy(const cplib_halo_slab* s, char* dense, cudaStream_t stream) {
  if (!valid(s)) return CPLIB_EINVAL;
  Geometry g{};
  g.ndim = s->ndim;
  g.total = 1;
  for (int d = 0; d < s->ndim; ++d) {
    g.shape[d] = d == s->dim ? s->width : s->sizes[d];
    g.strides[d] = s->strides[d];
    g.total *= g.shape[d];
  }
  if (g.total == 0) return CPLIB_OK;
  if (s->data == nullptr || dense == nullptr) return CPLIB_EINVAL;
  char* base = static_cast<char*>(s->data) + s->start * s->strides[s->dim] * s->elem_size;
  switch (s->elem_size) {
    case 1: return launch<uint8_t, ToDense>(g, base, dense, stream);
    case 2: return launch<uint16_t, ToDense>(g, base, dense, stream);
    case 4: return launch<uint32_t, ToDense>(g, base, dense, stream);
    case 8: return launch<uint64_t, ToDense>(g, base, dense, stream);
    default: return CPLIB_EINVAL;
  }
}

}  // namespace

extern "C" int cplib_halo_pack_cuda(const cplib_halo_slab* s, void* buf, void* stream) {
  return halo_copy<true>(s, static_cast<char*>(buf), static_cast<cudaStream_t>(stream));
}

extern "C" int cplib_halo_unpack_cuda(const cplib_halo_slab* s, const void* buf, void* stream) {
  // The dense side is only read in this direction.
  return halo_copy<false>(s, const_cast<char*>(static_cast<const char*>(buf)),
                          static_cast<cudaStream_t>(stream));
}
