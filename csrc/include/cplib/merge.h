/* Fused in-place merge of a partial attention result into running (out, lse).
 *
 * For each (b, h, r) with r in [0, rows):
 *   a = lse[b,h,row_offset+r], c = blk_lse[b,h,r]
 *   lse' = logaddexp(a, c)
 *   out[b,h,row_offset+r,:] += sigmoid(c - a) * (blk_out[b,h,r,:] - out[...])
 * which is exactly softmax-weighted combination of the two partial results,
 * written in the form that stays finite when either side is -inf.
 */
#ifndef CPLIB_MERGE_H
#define CPLIB_MERGE_H

#include "cplib/types.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  void* out;             /* acc_dtype, [batch, heads, *, dim] */
  void* lse;             /* acc_dtype, [batch, heads, *] */
  const void* blk_out;   /* blk_dtype, [batch, heads, rows, dim] */
  const void* blk_lse;   /* acc_dtype, [batch, heads, rows] */
  cplib_dtype acc_dtype; /* CPLIB_F32 or CPLIB_F64 */
  cplib_dtype blk_dtype; /* any; must equal acc_dtype when that is CPLIB_F64 */
  int64_t batch, heads, rows, dim;
  int64_t row_offset;    /* first accumulator row the block lands on */
  int64_t out_stride[4]; /* element strides of out */
  int64_t lse_stride[3];
  int64_t blk_out_stride[4];
  int64_t blk_lse_stride[3];
} cplib_merge_params;

/* CPU (C11, OpenMP when available). */
int cplib_merge_cpu(const cplib_merge_params* p);

/* CUDA; stream is a cudaStream_t. Defined only in CUDA builds. */
int cplib_merge_cuda(const cplib_merge_params* p, void* stream);

#ifdef __cplusplus
}
#endif
#endif
