/* Combine partial results over rows in one pass: the ring's partial attention
 * outputs of several steps (weighted by their log-sum-exp), or partial
 * gradients (a plain sum).
 *
 * For each (b, h, r) with r in [0, rows), over the parts j that cover row r
 * (part_j.row_offset <= r < part_j.row_offset + part_j.rows):
 *   weighted: lse[b,h,r] = logsumexp_j lse_j,  w_j = exp(lse_j - lse[b,h,r])
 *   plain:    w_j = 1
 *   out[b,h,r,:] = sum_j w_j * part_j[b,h,r - row_offset_j,:]
 * computed in acc_dtype and written once in out_dtype. A row that no part
 * covers, or whose parts all have lse -inf (they saw no key), gets out 0
 * and lse -inf; a part whose lse is -inf adds nothing (its values are not
 * read). `out` may be one of the parts (an accumulator folded again) when
 * that part covers every row with the same strides and dtype (each element
 * is read before it is written, by one thread); `lse` may not alias a
 * part's lse (a row's weights are read by several threads).
 */
#ifndef CPLIB_COMBINE_H
#define CPLIB_COMBINE_H

#include "cplib/types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Parts per call: what the ring holds before it folds (see partial_sum.h). */
#define CPLIB_COMBINE_MAX_PARTS 8

typedef struct {
  const void* data; /* dtype, [batch, heads, rows, dim] */
  const void* lse;  /* acc_dtype, [batch, heads, rows]; NULL in a plain sum */
  cplib_dtype dtype;
  int64_t row_offset, rows;
  int64_t stride[4];
  int64_t lse_stride[3];
} cplib_combine_part;

typedef struct {
  void* out; /* out_dtype, [batch, heads, rows, dim] */
  void* lse; /* acc_dtype, [batch, heads, rows]; NULL in a plain sum */
  cplib_dtype out_dtype;
  cplib_dtype acc_dtype; /* CPLIB_F32, or CPLIB_F64 (then every dtype is CPLIB_F64) */
  int weighted;          /* 1: by the parts' lse; 0: a plain sum */
  int64_t batch, heads, rows, dim;
  int64_t out_stride[4];
  int64_t lse_stride[3];
  int nparts;
  cplib_combine_part parts[CPLIB_COMBINE_MAX_PARTS];
} cplib_combine_params;

/* Checks what both implementations need (CPLIB_EINVAL otherwise). */
int cplib_combine_check(const cplib_combine_params* p);

/* CPU (C11, OpenMP when available). */
int cplib_combine_cpu(const cplib_combine_params* p);

/* CUDA; stream is a cudaStream_t. Defined only in CUDA builds. */
int cplib_combine_cuda(const cplib_combine_params* p, void* stream);

#ifdef __cplusplus
}
#endif
#endif
