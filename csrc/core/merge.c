/* CPU fused merge of partial attention results; see cplib/merge.h.
 *
 * Rows are taken in chunks of one (batch, head): a first vectorised pass
 * turns the chunk's two lse columns into weights and the new lse, a second
 * streams out/blk_out once. Splitting the passes keeps exp/log1p out of the
 * streaming loop, which is what lets the merge run near copy bandwidth. */
#include <math.h>
#include <stddef.h>

#include "cplib/merge.h"
#include "half.h"
#include "vecmath.h"

enum { CHUNK_ROWS = 256 };

/* One chunk's view: rows [r0, r0 + n) of one (batch, head). */
typedef struct {
  const cplib_merge_params* p;
  int64_t b, h, r0, n;
} chunk;

static float load_f32(const void* base, int64_t idx, cplib_dtype t) {
  switch (t) {
    case CPLIB_F32: return ((const float*)base)[idx];
    case CPLIB_BF16: return cplib_bf16_to_f32(((const uint16_t*)base)[idx]);
    case CPLIB_F16: return cplib_f16_to_f32(((const uint16_t*)base)[idx]);
    case CPLIB_F64: return (float)((const double*)base)[idx];
  }
  return 0.0f;
}

/* w = sigmoid(c - a) and lse = logaddexp(a, c) from one exp and one log1p:
 * with e = exp(-|a - c|), w is 1/(1+e) or e/(1+e) and lse = max + log1p(e).
 * A block row that saw no key (c = -inf) gets w = 0 and keeps its lse; an
 * empty accumulator row (a = -inf) gets e = 0, so w = 1 and lse = c. */
CPLIB_CPU_CLONES
static void weights_f32(int64_t n, float* lse, int64_t ls, const float* blk_lse, int64_t bls,
                        float* w) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float a = lse[i * ls], c = blk_lse[i * bls];
    const float e = cplib_exp_nonpos_f32(-fabsf(a - c));
    const float hi = a > c ? a : c;
    const int empty = c == -INFINITY;
    w[i] = empty ? 0.0f : (c >= a ? 1.0f : e) / (1.0f + e);
    lse[i * ls] = empty ? a : hi + cplib_log1p_unit_f32(e);
  }
}

/* out += w * (blk - out), unit stride on dim (the common layout). */
CPLIB_CPU_CLONES
static void apply_f32_dense(int64_t n, int64_t dim, float* out, int64_t ors, const float* blk,
                            int64_t brs, const float* w) {
  for (int64_t r = 0; r < n; ++r) {
    if (w[r] == 0.0f) continue; /* nothing to add (or c = -inf: blk may be garbage) */
    float* restrict o = out + r * ors;
    const float* restrict x = blk + r * brs;
    const float wr = w[r];
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) o[d] += wr * (x[d] - o[d]);
  }
}

CPLIB_CPU_CLONES
static void apply_bf16_dense(int64_t n, int64_t dim, float* out, int64_t ors, const uint16_t* blk,
                             int64_t brs, const float* w) {
  for (int64_t r = 0; r < n; ++r) {
    if (w[r] == 0.0f) continue;
    float* restrict o = out + r * ors;
    const uint16_t* restrict x = blk + r * brs;
    const float wr = w[r];
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) o[d] += wr * (cplib_bf16_to_f32(x[d]) - o[d]);
  }
}

static void merge_chunk_f32(const chunk* c) {
  const cplib_merge_params* p = c->p;
  float w[CHUNK_ROWS];
  const int64_t row = c->r0 + p->row_offset;
  float* lse = (float*)p->lse + c->b * p->lse_stride[0] + c->h * p->lse_stride[1] +
               row * p->lse_stride[2];
  const float* blk_lse = (const float*)p->blk_lse + c->b * p->blk_lse_stride[0] +
                         c->h * p->blk_lse_stride[1] + c->r0 * p->blk_lse_stride[2];
  weights_f32(c->n, lse, p->lse_stride[2], blk_lse, p->blk_lse_stride[2], w);

  float* out = (float*)p->out + c->b * p->out_stride[0] + c->h * p->out_stride[1] +
               row * p->out_stride[2];
  const int64_t blk0 = c->b * p->blk_out_stride[0] + c->h * p->blk_out_stride[1] +
                       c->r0 * p->blk_out_stride[2];
  const int64_t os = p->out_stride[3], bs = p->blk_out_stride[3];
  const int64_t ors = p->out_stride[2], brs = p->blk_out_stride[2];
  if (os == 1 && bs == 1 && p->blk_dtype == CPLIB_F32) {
    apply_f32_dense(c->n, p->dim, out, ors, (const float*)p->blk_out + blk0, brs, w);
  } else if (os == 1 && bs == 1 && p->blk_dtype == CPLIB_BF16) {
    apply_bf16_dense(c->n, p->dim, out, ors, (const uint16_t*)p->blk_out + blk0, brs, w);
  } else {
    for (int64_t r = 0; r < c->n; ++r) {
      if (w[r] == 0.0f) continue;
      float* o = out + r * ors;
      for (int64_t d = 0; d < p->dim; ++d) {
        const float x = load_f32(p->blk_out, blk0 + r * brs + d * bs, p->blk_dtype);
        o[d * os] += w[r] * (x - o[d * os]);
      }
    }
  }
}

/* fp64 accumulators serve exactness tests, not speed: libm, row by row. */
static void merge_chunk_f64(const chunk* c) {
  const cplib_merge_params* p = c->p;
  for (int64_t i = 0; i < c->n; ++i) {
    const int64_t r = c->r0 + i, row = r + p->row_offset;
    double* lse = (double*)p->lse + c->b * p->lse_stride[0] + c->h * p->lse_stride[1] +
                  row * p->lse_stride[2];
    const double cl =
        ((const double*)p->blk_lse)[c->b * p->blk_lse_stride[0] + c->h * p->blk_lse_stride[1] +
                                    r * p->blk_lse_stride[2]];
    if (cl == -INFINITY) continue;
    const double a = *lse;
    double w = 1.0;
    if (a == -INFINITY) {
      *lse = cl;
    } else {
      const double e = exp(-fabs(a - cl));
      w = (cl >= a ? 1.0 : e) / (1.0 + e);
      *lse = fmax(a, cl) + log1p(e);
    }
    double* o = (double*)p->out + c->b * p->out_stride[0] + c->h * p->out_stride[1] +
                row * p->out_stride[2];
    const double* x = (const double*)p->blk_out + c->b * p->blk_out_stride[0] +
                      c->h * p->blk_out_stride[1] + r * p->blk_out_stride[2];
    const int64_t os = p->out_stride[3], bs = p->blk_out_stride[3];
    for (int64_t d = 0; d < p->dim; ++d) o[d * os] += w * (x[d * bs] - o[d * os]);
  }
}

int cplib_merge_cpu(const cplib_merge_params* p) {
  if (p == NULL || p->out == NULL || p->lse == NULL || p->blk_out == NULL || p->blk_lse == NULL)
    return CPLIB_EINVAL;
  if (p->acc_dtype != CPLIB_F32 && p->acc_dtype != CPLIB_F64) return CPLIB_EINVAL;
  if (p->acc_dtype == CPLIB_F64 && p->blk_dtype != CPLIB_F64) return CPLIB_EINVAL;
  if (p->batch < 0 || p->heads < 0 || p->rows < 0 || p->dim < 0 || p->row_offset < 0)
    return CPLIB_EINVAL;
  const int64_t per_head = (p->rows + CHUNK_ROWS - 1) / CHUNK_ROWS;
  const int64_t tasks = p->batch * p->heads * per_head;
  const int is_f64 = p->acc_dtype == CPLIB_F64;
#pragma omp parallel for schedule(static) if (p->batch * p->heads * p->rows * p->dim > (1 << 16))
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t bh = t / per_head, k = t % per_head;
    chunk c = {p, bh / p->heads, bh % p->heads, k * CHUNK_ROWS, 0};
    c.n = p->rows - c.r0 < CHUNK_ROWS ? p->rows - c.r0 : CHUNK_ROWS;
    if (is_f64)
      merge_chunk_f64(&c);
    else
      merge_chunk_f32(&c);
  }
  return CPLIB_OK;
}
