/* Halo packing: copy a slab of a strided N-D tensor (the indices
 * [start, start + width) along one dim, everything along the others) into a
 * contiguous buffer, or back. The buffer is laid out in row-major order over
 * the slab's shape, so it can be sent as is and viewed on the receiver as a
 * tensor of that shape. Elements are moved as raw bytes (any dtype).
 */
#ifndef CPLIB_HALO_H
#define CPLIB_HALO_H

#include "cplib/types.h"

#ifdef __cplusplus
extern "C" {
#endif

#define CPLIB_HALO_MAX_DIMS 8

typedef struct {
  void* data;        /* element 0 of the strided tensor */
  int64_t elem_size; /* bytes per element: 1, 2, 4 or 8 */
  int ndim;          /* 1 .. CPLIB_HALO_MAX_DIMS */
  int64_t sizes[CPLIB_HALO_MAX_DIMS];
  int64_t strides[CPLIB_HALO_MAX_DIMS]; /* in elements, may be any non-negative value */
  int dim;                              /* the dim the slab is cut along */
  int64_t start;                        /* first index of the slab along dim */
  int64_t width;                        /* number of indices along dim; 0 copies nothing */
} cplib_halo_slab;

/* CPU (C11, OpenMP when available). Return CPLIB_OK or CPLIB_EINVAL. */
int cplib_halo_pack_cpu(const cplib_halo_slab* s, void* buf);
int cplib_halo_unpack_cpu(const cplib_halo_slab* s, const void* buf);

/* CUDA; stream is a cudaStream_t. Defined only in CUDA builds. */
int cplib_halo_pack_cuda(const cplib_halo_slab* s, void* buf, void* stream);
int cplib_halo_unpack_cuda(const cplib_halo_slab* s, const void* buf, void* stream);

#ifdef __cplusplus
}
#endif
#endif
