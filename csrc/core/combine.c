/* CPU combine of partial results over rows; see cplib/combine.h.
 *
 * Rows are taken in chunks of one (batch, head), as in merge.c: a first pass
 * turns the chunk's lse columns into one weight per part and row (and the
 * combined lse), a second streams every part's rows once into a float row
 * buffer and writes each row once in the output dtype. */
#include <math.h>
#include <stddef.h>
#include <string.h>

#include "cplib/combine.h"
#include "half.h"
#include "vecmath.h"

enum { CHUNK_ROWS = 128, DIM_TILE = 512 };

int cplib_combine_check(const cplib_combine_params* p) {
  if (p == NULL || p->nparts < 0 || p->nparts > CPLIB_COMBINE_MAX_PARTS) return CPLIB_EINVAL;
  if (p->batch < 0 || p->heads < 0 || p->rows < 0 || p->dim < 0) return CPLIB_EINVAL;
  if (p->acc_dtype != CPLIB_F32 && p->acc_dtype != CPLIB_F64) return CPLIB_EINVAL;
  /* Empty tensors may have no storage: pointers are needed only with elements. */
  const int empty = p->batch == 0 || p->heads == 0 || p->rows == 0;
  if (!empty && (p->out == NULL && p->dim > 0)) return CPLIB_EINVAL;
  if (!empty && p->weighted && p->lse == NULL) return CPLIB_EINVAL;
  const int f64 = p->acc_dtype == CPLIB_F64;
  if (f64 && p->out_dtype != CPLIB_F64) return CPLIB_EINVAL;
  if (!f64 && p->out_dtype == CPLIB_F64) return CPLIB_EINVAL;
  int other = -1; /* the one dtype besides the accumulator's that parts may have */
  for (int j = 0; j < p->nparts; ++j) {
    const cplib_combine_part* q = &p->parts[j];
    const int has_rows = !empty && q->rows > 0;
    if (has_rows && ((q->data == NULL && p->dim > 0) || (p->weighted && q->lse == NULL)))
      return CPLIB_EINVAL;
    if (q->row_offset < 0 || q->rows < 0 || q->row_offset + q->rows > p->rows) return CPLIB_EINVAL;
    if (f64 ? q->dtype != CPLIB_F64 : q->dtype == CPLIB_F64) return CPLIB_EINVAL;
    if (q->dtype != p->acc_dtype) {
      if (other >= 0 && (int)q->dtype != other) return CPLIB_EINVAL;
      other = (int)q->dtype;
    }
  }
  if (p->out_dtype != p->acc_dtype && other >= 0 && (int)p->out_dtype != other) return CPLIB_EINVAL;
  return CPLIB_OK;
}

/* The output's rounding to its dtype (round to nearest even, as torch). */
static uint16_t f32_to_bf16(float f) {
  uint32_t x;
  memcpy(&x, &f, sizeof x);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u); /* NaN stays NaN */
  x += 0x7fffu + ((x >> 16) & 1u);
  return (uint16_t)(x >> 16);
}

static uint16_t f32_to_f16(float f) {
  uint32_t x;
  memcpy(&x, &f, sizeof x);
  const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);  /* NaN */
  if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520 rounds to inf */
  if (ax < 0x38800000u) {                                   /* below 2^-14: subnormal */
    if (ax <= 0x33000000u) return (uint16_t)sign;           /* <= 2^-25: to zero (ties even) */
    const uint32_t e = ax >> 23, m = (ax & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - e; /* in units of 2^-24: m * 2^(e - 126) */
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return (uint16_t)(sign | r);
  }
  uint32_t r = (ax - 0x38000000u) >> 13; /* exponent rebiased from 127 to 15 */
  const uint32_t rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r; /* a carry rounds up the exponent */
  return (uint16_t)(sign | r);
}

typedef struct {
  const cplib_combine_params* p;
  int64_t b, h, r0, n;
} chunk;

static int64_t covers(const cplib_combine_part* q, int64_t r) {
  return r >= q->row_offset && r < q->row_offset + q->rows;
}

/* dst[d] = w * x[d] for a row's first contributing part, dst[d] = src[d] +
 * w * x[d] after it, over one tile of a part's row (unit stride in the
 * common case). dst may be src, and the last part of a float output writes
 * the output row itself (which in a fold is also part 0's row: element d is
 * read before it is written, so `omp simd` holds). No zeroing or copying
 * pass: at the ring's sizes (rows of 64) either cost as much as the sum. */
static inline void add_row_f32(float* dst, const float* src, const void* base, cplib_dtype t,
                               int64_t at, int64_t ds, int64_t n, float w, int first) {
  if (t == CPLIB_F32 && ds == 1) {
    const float* x = (const float*)base + at;
    if (first) {
#pragma omp simd
      for (int64_t d = 0; d < n; ++d) dst[d] = w * x[d];
    } else {
#pragma omp simd
      for (int64_t d = 0; d < n; ++d) dst[d] = src[d] + w * x[d];
    }
  } else if (t == CPLIB_BF16 && ds == 1) {
    const uint16_t* x = (const uint16_t*)base + at;
    if (first) {
#pragma omp simd
      for (int64_t d = 0; d < n; ++d) dst[d] = w * cplib_bf16_to_f32(x[d]);
    } else {
#pragma omp simd
      for (int64_t d = 0; d < n; ++d) dst[d] = src[d] + w * cplib_bf16_to_f32(x[d]);
    }
  } else {
    for (int64_t d = 0; d < n; ++d) {
      const int64_t i = at + d * ds;
      const float x = t == CPLIB_F32    ? ((const float*)base)[i]
                      : t == CPLIB_BF16 ? cplib_bf16_to_f32(((const uint16_t*)base)[i])
                                        : cplib_f16_to_f32(((const uint16_t*)base)[i]);
      dst[d] = first ? w * x : src[d] + w * x;
    }
  }
}

/* The dtype is tested once per row, not per element. */
static inline void store_row_f32(void* base, cplib_dtype t, int64_t at, int64_t ds, int64_t n,
                                 const float* acc) {
  if (t == CPLIB_F32) {
    for (int64_t d = 0; d < n; ++d) ((float*)base)[at + d * ds] = acc[d];
  } else if (t == CPLIB_BF16) {
    for (int64_t d = 0; d < n; ++d) ((uint16_t*)base)[at + d * ds] = f32_to_bf16(acc[d]);
  } else {
    for (int64_t d = 0; d < n; ++d) ((uint16_t*)base)[at + d * ds] = f32_to_f16(acc[d]);
  }
}

/* One clone per ISA for the whole chunk, so the row loops inline into it and
 * a row costs its arithmetic, not calls (the ring's fp32 blocks at S=64 are
 * a few hundred rows of 64: per-row overhead was most of the time). */
CPLIB_CPU_CLONES
static void combine_chunk_f32(const chunk* c) {
  const cplib_combine_params* p = c->p;
  float w[CPLIB_COMBINE_MAX_PARTS][CHUNK_ROWS];
  float m[CHUNK_ROWS], sum[CHUNK_ROWS], lse[CHUNK_ROWS];
  float acc[DIM_TILE];
  const int64_t n = c->n;
  /* The weights, a loop over the chunk's rows for each part (rows are the
   * vector lanes; per row they were most of the combine's time). A part's
   * log-sum-exp where it covers the row, -inf where not. */
  for (int64_t i = 0; i < n; ++i) m[i] = -INFINITY;
  for (int j = 0; j < p->nparts; ++j) {
    const cplib_combine_part* q = &p->parts[j];
    const int64_t lo = q->row_offset > c->r0 ? q->row_offset - c->r0 : 0;
    const int64_t end = q->row_offset + q->rows - c->r0;
    const int64_t hi = end < lo ? lo : end < n ? end : n;
    float* restrict wj = w[j];
    for (int64_t i = 0; i < n; ++i) wj[i] = -INFINITY;
    if (p->weighted) {
      const int64_t ls = q->lse_stride[2];
      const float* src = (const float*)q->lse + c->b * q->lse_stride[0] + c->h * q->lse_stride[1];
      for (int64_t i = lo; i < hi; ++i) wj[i] = src[(c->r0 + i - q->row_offset) * ls];
    } else {
      for (int64_t i = lo; i < hi; ++i) wj[i] = 0.0f;
    }
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) m[i] = wj[i] > m[i] ? wj[i] : m[i];
  }
  if (p->weighted) {
    for (int64_t i = 0; i < n; ++i) sum[i] = 0.0f;
    for (int j = 0; j < p->nparts; ++j) {
      const float* restrict wj = w[j];
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) sum[i] += cplib_exp_nonpos_f32(wj[i] - m[i]);
    }
    for (int64_t i = 0; i < n; ++i) lse[i] = m[i] == -INFINITY ? -INFINITY : m[i] + logf(sum[i]);
    float* out_lse = (float*)p->lse + c->b * p->lse_stride[0] + c->h * p->lse_stride[1] +
                     c->r0 * p->lse_stride[2];
    for (int64_t i = 0; i < n; ++i) out_lse[i * p->lse_stride[2]] = lse[i];
  }
  for (int j = 0; j < p->nparts; ++j) {
    float* restrict wj = w[j];
    if (p->weighted) {
#pragma omp simd
      for (int64_t i = 0; i < n; ++i)
        wj[i] = wj[i] == -INFINITY ? 0.0f : cplib_exp_nonpos_f32(wj[i] - lse[i]);
    } else {
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) wj[i] = wj[i] == -INFINITY ? 0.0f : 1.0f;
    }
  }
  const int64_t ob = c->b * p->out_stride[0] + c->h * p->out_stride[1];
  /* A float output of unit stride takes the last part's sum directly. */
  const int direct = p->out_dtype == CPLIB_F32 && p->out_stride[3] == 1;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = c->r0 + i;
    int last = -1;
    for (int j = 0; j < p->nparts; ++j)
      if (w[j][i] != 0.0f) last = j; /* 0: not covering, or saw no key: its values unread */
    for (int64_t d0 = 0; d0 < p->dim; d0 += DIM_TILE) {
      const int64_t nd = p->dim - d0 < DIM_TILE ? p->dim - d0 : DIM_TILE;
      const int64_t o = ob + r * p->out_stride[2] + d0 * p->out_stride[3];
      float* const row = direct ? (float*)p->out + o : acc;
      int first = 1;
      for (int j = 0; j <= last; ++j) {
        const cplib_combine_part* q = &p->parts[j];
        if (w[j][i] == 0.0f) continue;
        const int64_t at = c->b * q->stride[0] + c->h * q->stride[1] +
                           (r - q->row_offset) * q->stride[2] + d0 * q->stride[3];
        add_row_f32(j == last ? row : acc, acc, q->data, q->dtype, at, q->stride[3], nd, w[j][i],
                    first);
        first = 0;
      }
      if (first)
        for (int64_t d = 0; d < nd; ++d) row[d] = 0.0f; /* a row no part reached */
      if (!direct) store_row_f32(p->out, p->out_dtype, o, p->out_stride[3], nd, acc);
    }
  }
}

/* fp64 serves exactness tests, not speed: libm, row by row. */
static void combine_chunk_f64(const chunk* c) {
  const cplib_combine_params* p = c->p;
  double w[CPLIB_COMBINE_MAX_PARTS];
  for (int64_t i = 0; i < c->n; ++i) {
    const int64_t r = c->r0 + i;
    double m = -INFINITY;
    for (int j = 0; j < p->nparts; ++j) {
      const cplib_combine_part* q = &p->parts[j];
      w[j] = !covers(q, r) ? -INFINITY
             : !p->weighted
                 ? 0.0
                 : ((const double*)q->lse)[c->b * q->lse_stride[0] + c->h * q->lse_stride[1] +
                                           (r - q->row_offset) * q->lse_stride[2]];
      m = w[j] > m ? w[j] : m;
    }
    double lse = -INFINITY;
    if (m != -INFINITY) {
      double s = 0.0;
      for (int j = 0; j < p->nparts; ++j) s += exp(w[j] - m);
      lse = m + log(s);
    }
    if (p->weighted)
      ((double*)p->lse)[c->b * p->lse_stride[0] + c->h * p->lse_stride[1] + r * p->lse_stride[2]] =
          lse;
    for (int j = 0; j < p->nparts; ++j)
      w[j] = w[j] == -INFINITY ? 0.0 : p->weighted ? exp(w[j] - lse) : 1.0;
    double* o = (double*)p->out + c->b * p->out_stride[0] + c->h * p->out_stride[1] +
                r * p->out_stride[2];
    for (int64_t d = 0; d < p->dim; ++d) {
      double sum = 0.0;
      for (int j = 0; j < p->nparts; ++j) {
        const cplib_combine_part* q = &p->parts[j];
        if (w[j] == 0.0) continue;
        sum += w[j] *
               ((const double*)q->data)[c->b * q->stride[0] + c->h * q->stride[1] +
                                        (r - q->row_offset) * q->stride[2] + d * q->stride[3]];
      }
      o[d * p->out_stride[3]] = sum;
    }
  }
}

int cplib_combine_cpu(const cplib_combine_params* p) {
  const int status = cplib_combine_check(p);
  if (status != CPLIB_OK) return status;
  const int64_t per_head = (p->rows + CHUNK_ROWS - 1) / CHUNK_ROWS;
  const int64_t tasks = p->batch * p->heads * per_head;
  const int is_f64 = p->acc_dtype == CPLIB_F64;
#pragma omp parallel for schedule(static) if (p->batch * p->heads * p->rows * p->dim > (1 << 16))
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t bh = t / per_head, k = t % per_head;
    chunk c = {p, bh / p->heads, bh % p->heads, k * CHUNK_ROWS, 0};
    c.n = p->rows - c.r0 < CHUNK_ROWS ? p->rows - c.r0 : CHUNK_ROWS;
    if (is_f64)
      combine_chunk_f64(&c);
    else
      combine_chunk_f32(&c);
  }
  return CPLIB_OK;
}
