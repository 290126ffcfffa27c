/* CPU fused merge of partial attention results; see cplib/merge.h. */
#include <math.h>
#include <stddef.h>

#include "cplib/merge.h"
#include "half.h"

static inline double load_elem(const void* base, int64_t idx, cplib_dtype t) {
  switch (t) {
    case CPLIB_F32: return ((const float*)base)[idx];
    case CPLIB_F64: return ((const double*)base)[idx];
    case CPLIB_BF16: return cplib_bf16_to_f32(((const uint16_t*)base)[idx]);
    case CPLIB_F16: return cplib_f16_to_f32(((const uint16_t*)base)[idx]);
  }
  return 0.0;
}

/* One row: the weight is computed once, then a single pass over dim. The
 * float path stays in float so the compiler can vectorise the inner loop. */
static void merge_row_f32(const cplib_merge_params* p, int64_t b, int64_t h, int64_t r) {
  float* lse = (float*)p->lse + b * p->lse_stride[0] + h * p->lse_stride[1] +
               (r + p->row_offset) * p->lse_stride[2];
  const float c = ((const float*)p->blk_lse)[b * p->blk_lse_stride[0] +
                                             h * p->blk_lse_stride[1] + r * p->blk_lse_stride[2]];
  if (c == -INFINITY) return; /* the block saw no key for this row */
  const float a = *lse;
  float* out = (float*)p->out + b * p->out_stride[0] + h * p->out_stride[1] +
               (r + p->row_offset) * p->out_stride[2];
  const int64_t blk_base = b * p->blk_out_stride[0] + h * p->blk_out_stride[1] +
                           r * p->blk_out_stride[2];
  const int64_t os = p->out_stride[3], bs = p->blk_out_stride[3];
  float w;
  if (a == -INFINITY) {
    w = 1.0f;
    *lse = c;
  } else {
    /* one exp per row: e = exp(-|a - c|) gives both the weight and the lse */
    const float e = expf(-fabsf(a - c));
    w = c >= a ? 1.0f / (1.0f + e) : e / (1.0f + e);
    *lse = fmaxf(a, c) + log1pf(e);
  }
  if (os == 1 && bs == 1 && p->blk_dtype == CPLIB_F32) {
    /* unit strides (the common case): a loop the compiler vectorises */
    const float* restrict blk = (const float*)p->blk_out + blk_base;
    float* restrict o = out;
    for (int64_t d = 0; d < p->dim; ++d) o[d] += w * (blk[d] - o[d]);
  } else if (os == 1 && bs == 1 && p->blk_dtype == CPLIB_BF16) {
    const uint16_t* restrict blk = (const uint16_t*)p->blk_out + blk_base;
    float* restrict o = out;
    for (int64_t d = 0; d < p->dim; ++d) o[d] += w * (cplib_bf16_to_f32(blk[d]) - o[d]);
  } else if (p->blk_dtype == CPLIB_F32) {
    const float* blk = (const float*)p->blk_out + blk_base;
    for (int64_t d = 0; d < p->dim; ++d) out[d * os] += w * (blk[d * bs] - out[d * os]);
  } else {
    for (int64_t d = 0; d < p->dim; ++d) {
      float v = (float)load_elem(p->blk_out, blk_base + d * bs, p->blk_dtype);
      out[d * os] += w * (v - out[d * os]);
    }
  }
}

static void merge_row_f64(const cplib_merge_params* p, int64_t b, int64_t h, int64_t r) {
  double* lse = (double*)p->lse + b * p->lse_stride[0] + h * p->lse_stride[1] +
                (r + p->row_offset) * p->lse_stride[2];
  const double c = ((const double*)p->blk_lse)[b * p->blk_lse_stride[0] +
                                               h * p->blk_lse_stride[1] + r * p->blk_lse_stride[2]];
  if (c == -INFINITY) return;
  const double a = *lse;
  double* out = (double*)p->out + b * p->out_stride[0] + h * p->out_stride[1] +
                (r + p->row_offset) * p->out_stride[2];
  const double* blk = (const double*)p->blk_out + b * p->blk_out_stride[0] +
                      h * p->blk_out_stride[1] + r * p->blk_out_stride[2];
  const int64_t os = p->out_stride[3], bs = p->blk_out_stride[3];
  double w;
  if (a == -INFINITY) {
    w = 1.0;
    *lse = c;
  } else {
    w = 1.0 / (1.0 + exp(a - c));
    *lse = fmax(a, c) + log1p(exp(-fabs(a - c)));
  }
  for (int64_t d = 0; d < p->dim; ++d) out[d * os] += w * (blk[d * bs] - out[d * os]);
}

int cplib_merge_cpu(const cplib_merge_params* p) {
  if (p == NULL || p->out == NULL || p->lse == NULL || p->blk_out == NULL || p->blk_lse == NULL)
    return CPLIB_EINVAL;
  if (p->acc_dtype != CPLIB_F32 && p->acc_dtype != CPLIB_F64) return CPLIB_EINVAL;
  if (p->acc_dtype == CPLIB_F64 && p->blk_dtype != CPLIB_F64) return CPLIB_EINVAL;
  if (p->batch < 0 || p->heads < 0 || p->rows < 0 || p->dim < 0 || p->row_offset < 0)
    return CPLIB_EINVAL;
  const int64_t n = p->batch * p->heads * p->rows;
  const int is_f64 = p->acc_dtype == CPLIB_F64;
#pragma omp parallel for schedule(static) if (n * p->dim > (1 << 16))
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = i % p->rows;
    const int64_t h = (i / p->rows) % p->heads;
    const int64_t b = i / (p->rows * p->heads);
    if (is_f64)
      merge_row_f64(p, b, h, r);
    else
      merge_row_f32(p, b, h, r);
  }
  return CPLIB_OK;
}
