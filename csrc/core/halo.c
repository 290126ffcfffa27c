/* CPU halo packing; see cplib/halo.h. The slab is walked as rows: every dim
 * but the last forms the outer index, the last dim is copied as one run
 * (memcpy when it is unit-stride, element by element otherwise). */
#include <stddef.h>
#include <string.h>

#include "cplib/halo.h"

static int slab_valid(const cplib_halo_slab* s) {
  if (s == NULL || s->ndim < 1 || s->ndim > CPLIB_HALO_MAX_DIMS) return 0;
  if (s->elem_size != 1 && s->elem_size != 2 && s->elem_size != 4 && s->elem_size != 8) return 0;
  if (s->dim < 0 || s->dim >= s->ndim || s->start < 0 || s->width < 0) return 0;
  if (s->start + s->width > s->sizes[s->dim]) return 0;
  for (int d = 0; d < s->ndim; ++d)
    if (s->sizes[d] < 0 || s->strides[d] < 0) return 0;
  return 1;
}

/* Copies n elements between a run of stride `ts` in the tensor and a dense run. */
static void copy_run(char* tensor, int64_t ts, char* dense, int64_t n, int64_t es, int to_dense) {
  if (ts == 1) {
    if (to_dense)
      memcpy(dense, tensor, (size_t)(n * es));
    else
      memcpy(tensor, dense, (size_t)(n * es));
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    char* t = tensor + i * ts * es;
    char* b = dense + i * es;
    if (to_dense)
      memcpy(b, t, (size_t)es);
    else
      memcpy(t, b, (size_t)es);
  }
}

static int halo_copy(const cplib_halo_slab* s, char* buf, int to_dense) {
  if (!slab_valid(s) || (buf == NULL && s->width > 0)) return CPLIB_EINVAL;
  int64_t shape[CPLIB_HALO_MAX_DIMS];
  int64_t total = 1;
  for (int d = 0; d < s->ndim; ++d) {
    shape[d] = d == s->dim ? s->width : s->sizes[d];
    total *= shape[d];
  }
  if (total == 0) return CPLIB_OK;
  if (s->data == NULL) return CPLIB_EINVAL;
  const int last = s->ndim - 1;
  const int64_t run = shape[last], rows = total / run, es = s->elem_size;
  char* base = (char*)s->data + s->start * s->strides[s->dim] * es;
#pragma omp parallel for schedule(static) if (total > (1 << 16))
  for (int64_t row = 0; row < rows; ++row) {
    int64_t off = 0, rem = row;
    for (int d = last - 1; d >= 0; --d) {
      off += (rem % shape[d]) * s->strides[d];
      rem /= shape[d];
    }
    copy_run(base + off * es, s->strides[last], buf + row * run * es, run, es, to_dense);
  }
  return CPLIB_OK;
}

int cplib_halo_pack_cpu(const cplib_halo_slab* s, void* buf) { return halo_copy(s, (char*)buf, 1); }

int cplib_halo_unpack_cpu(const cplib_halo_slab* s, const void* buf) {
  /* The dense side is only read in this direction. */
  return halo_copy(s, (char*)(uintptr_t)buf, 0);
}
