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

/* acc[d] += w * x[d] over one tile of a part's row, unit stride in the common case. */
CPLIB_CPU_CLONES
static void add_row_f32(float* restrict acc, const void* base, cplib_dtype t, int64_t at,
                        int64_t ds, int64_t n, float w) {
  if (t == CPLIB_F32 && ds == 1) {
    const float* restrict x = (const float*)base + at;
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) acc[d] += w * x[d];
  } else if (t == CPLIB_BF16 && ds == 1) {
    const uint16_t* restrict x = (const uint16_t*)base + at;
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) acc[d] += w * cplib_bf16_to_f32(x[d]);
  } else {
    for (int64_t d = 0; d < n; ++d) {
      const int64_t i = at + d * ds;
      const float x = t == CPLIB_F32    ? ((const float*)base)[i]
                      : t == CPLIB_BF16 ? cplib_bf16_to_f32(((const uint16_t*)base)[i])
                                        : cplib_f16_to_f32(((const uint16_t*)base)[i]);
      acc[d] += w * x;
    }
  }
}

static void store_row_f32(void* base, cplib_dtype t, int64_t at, int64_t ds, int64_t n,
                          const float* acc) {
  for (int64_t d = 0; d < n; ++d) {
    const int64_t i = at + d * ds;
    if (t == CPLIB_F32)
      ((float*)base)[i] = acc[d];
    else if (t == CPLIB_BF16)
      ((uint16_t*)base)[i] = f32_to_bf16(acc[d]);
    else
      ((uint16_t*)base)[i] = f32_to_f16(acc[d]);
  }
}

static float part_lse_f32(const cplib_combine_part* q, int64_t b, int64_t h, int64_t r) {
  return ((const float*)q->lse)[b * q->lse_stride[0] + h * q->lse_stride[1] +
                                (r - q->row_offset) * q->lse_stride[2]];
}

static void combine_chunk_f32(const chunk* c) {
  const cplib_combine_params* p = c->p;
  float w[CPLIB_COMBINE_MAX_PARTS][CHUNK_ROWS];
  float acc[DIM_TILE];
  for (int64_t i = 0; i < c->n; ++i) {
    const int64_t r = c->r0 + i;
    float m = -INFINITY;
    for (int j = 0; j < p->nparts; ++j) {
      const cplib_combine_part* q = &p->parts[j];
      w[j][i] = !covers(q, r) ? -INFINITY : p->weighted ? part_lse_f32(q, c->b, c->h, r) : 0.0f;
      m = w[j][i] > m ? w[j][i] : m;
    }
    float lse = -INFINITY;
    if (m != -INFINITY) {
      float s = 0.0f;
      for (int j = 0; j < p->nparts; ++j) s += cplib_exp_nonpos_f32(w[j][i] - m);
      lse = m + logf(s);
    }
    for (int j = 0; j < p->nparts; ++j)
      w[j][i] = w[j][i] == -INFINITY ? 0.0f
                : p->weighted        ? cplib_exp_nonpos_f32(w[j][i] - lse)
                                     : 1.0f;
    if (p->weighted)
      ((float*)p->lse)[c->b * p->lse_stride[0] + c->h * p->lse_stride[1] + r * p->lse_stride[2]] =
          lse;
  }
  const int64_t ob = c->b * p->out_stride[0] + c->h * p->out_stride[1];
  for (int64_t i = 0; i < c->n; ++i) {
    const int64_t r = c->r0 + i;
    for (int64_t d0 = 0; d0 < p->dim; d0 += DIM_TILE) {
      const int64_t n = p->dim - d0 < DIM_TILE ? p->dim - d0 : DIM_TILE;
      for (int64_t d = 0; d < n; ++d) acc[d] = 0.0f;
      for (int j = 0; j < p->nparts; ++j) {
        const cplib_combine_part* q = &p->parts[j];
        if (w[j][i] == 0.0f) continue; /* not covering, or saw no key: its values unread */
        const int64_t at = c->b * q->stride[0] + c->h * q->stride[1] +
                           (r - q->row_offset) * q->stride[2] + d0 * q->stride[3];
        add_row_f32(acc, q->data, q->dtype, at, q->stride[3], n, w[j][i]);
      }
      store_row_f32(p->out, p->out_dtype, ob + r * p->out_stride[2] + d0 * p->out_stride[3],
                    p->out_stride[3], n, acc);
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
