/* Document placement; see cplib/placement.h. Work is counted doubled, in
 * integers: a share of t tokens of a document of L tokens costs t (L + 1). */
#include <stdlib.h>

#include "cplib/placement.h"

/* Products of a work sum (up to S (S + 1)) and a token count overflow 64 bits. */
__extension__ typedef __int128 wide;

/* A head cut moves onto a document boundary when the rank's deviation from
 * its target, and the running sum of the deviations, stay within 1/kSnap. */
enum { kSnap = 50 };

typedef struct {
  int64_t len, doc;
} doc_len;

typedef struct {
  int64_t doc, rank, tokens;
} share;

typedef struct {
  int64_t nd, total_tokens;
  const doc_len* order; /* documents, longest first */
  int64_t* vstart;      /* nd + 1: start of each document in the virtual sequence V */
  int64_t* prefix;      /* nd + 1: work of V before each document */
} virtual_seq;

static int longest_first(const void* a, const void* b) {
  const doc_len *x = a, *y = b;
  if (x->len != y->len) return x->len > y->len ? -1 : 1;
  return x->doc < y->doc ? -1 : x->doc > y->doc;
}

static int by_doc_then_share(const void* a, const void* b) {
  const share *x = a, *y = b;
  if (x->doc != y->doc) return x->doc < y->doc ? -1 : 1;
  if (x->tokens != y->tokens) return x->tokens > y->tokens ? -1 : 1;
  return x->rank < y->rank ? -1 : x->rank > y->rank;
}

static int by_rank_then_start(const void* a, const void* b) {
  const cplib_placed_piece *x = a, *y = b;
  if (x->rank != y->rank) return x->rank < y->rank ? -1 : 1;
  return x->start < y->start ? -1 : x->start > y->start;
}

/* The document of V holding position x (x < S), by binary search. */
static int64_t segment(const virtual_seq* v, int64_t x) {
  int64_t lo = 0, hi = v->nd - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (v->vstart[mid] <= x)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

/* Work of V[0, x). */
static int64_t work_to(const virtual_seq* v, int64_t x) {
  if (x >= v->total_tokens) return v->prefix[v->nd];
  const int64_t i = segment(v, x);
  return v->prefix[i] + (x - v->vstart[i]) * (v->order[i].len + 1);
}

/* Work of a rank taking V[front, front + h) and V[back - (c - h), back). */
static int64_t head_tail_work(const virtual_seq* v, int64_t front, int64_t back, int64_t c,
                              int64_t h) {
  return work_to(v, front + h) - work_to(v, front) + work_to(v, back) - work_to(v, back - (c - h));
}

static wide magnitude(wide x) { return x < 0 ? -x : x; }

/* The head length of a rank of capacity c: the one whose work is closest to
 * the target (`goal` = target x S), moved onto a document boundary where the
 * deviation and the running sum `*acc` allow; adds its deviation to *acc. */
static int64_t head_length(const virtual_seq* v, int64_t front, int64_t back, int64_t c, wide goal,
                           wide* acc) {
  const int64_t s = v->total_tokens;
  int64_t lo = 0, hi = c; /* work grows with h: V's density decreases */
  if ((wide)head_tail_work(v, front, back, c, 0) * s > goal) {
    hi = 0;
  } else {
    while (lo < hi) { /* the largest h whose work does not exceed the goal */
      const int64_t mid = (lo + hi + 1) / 2;
      if ((wide)head_tail_work(v, front, back, c, mid) * s <= goal)
        lo = mid;
      else
        hi = mid - 1;
    }
    if (lo < c) {
      const wide below = goal - (wide)head_tail_work(v, front, back, c, lo) * s;
      const wide above = (wide)head_tail_work(v, front, back, c, lo + 1) * s - goal;
      hi = above < below ? lo + 1 : lo;
    }
  }
  int64_t h = hi;
  wide dev = (wide)head_tail_work(v, front, back, c, h) * s - goal;
  const int64_t p = front + h;
  if (p < s) {
    const int64_t i = segment(v, p);
    if (v->vstart[i] != p) { /* the cut splits a document: try its two ends */
      const int64_t ends[2] = {v->vstart[i], v->vstart[i + 1]};
      wide best = -1;
      for (int e = 0; e < 2; ++e) {
        const int64_t x = ends[e] - front;
        if (x < 0 || x > c) continue;
        const wide d = (wide)head_tail_work(v, front, back, c, x) * s - goal;
        if (magnitude(d) * kSnap > goal || magnitude(*acc + d) * kSnap > goal) continue;
        if (best < 0 || magnitude(*acc + d) < best) {
          best = magnitude(*acc + d);
          h = x;
          dev = d;
        }
      }
    }
  }
  *acc += dev;
  return h;
}

/* Appends the shares of V[a, b) held by `rank`. */
static void add_run(const virtual_seq* v, int64_t a, int64_t b, int64_t rank, share* shares,
                    int64_t* n) {
  for (int64_t i = a < b ? segment(v, a) : v->nd; i < v->nd && v->vstart[i] < b; ++i) {
    const int64_t lo = v->vstart[i] > a ? v->vstart[i] : a;
    const int64_t end = v->vstart[i + 1] < b ? v->vstart[i + 1] : b;
    if (end <= lo) continue;
    if (*n > 0 && shares[*n - 1].doc == v->order[i].doc && shares[*n - 1].rank == rank) {
      shares[*n - 1].tokens += end - lo;
    } else {
      shares[*n] = (share){v->order[i].doc, rank, end - lo};
      ++*n;
    }
  }
}

/* Cuts every document into its shares' pieces: one piece when whole, else
 * head-tail, the largest share outermost. `shares` sorted by document. */
static int64_t cut_documents(const int64_t* bounds, const share* shares, int64_t n,
                             cplib_placed_piece* out) {
  int64_t count = 0;
  for (int64_t i = 0; i < n;) {
    int64_t j = i;
    while (j < n && shares[j].doc == shares[i].doc) ++j;
    int64_t lo = bounds[shares[i].doc], hi = bounds[shares[i].doc + 1];
    for (int64_t k = i; k < j; ++k) {
      const int64_t t = shares[k].tokens, front = j - i == 1 ? t : t / 2, back = t - front;
      if (front > 0) out[count++] = (cplib_placed_piece){shares[k].rank, lo, front};
      hi -= back;
      if (back > 0) out[count++] = (cplib_placed_piece){shares[k].rank, hi, back};
      lo += front;
    }
    i = j;
  }
  return count;
}

int64_t cplib_placement_max_pieces(int64_t docs, int64_t ranks) { return 2 * docs + 4 * ranks; }

static int bounds_valid(const int64_t* bounds, int64_t docs, int64_t ranks) {
  if (bounds == NULL || docs < 1 || ranks < 1 || bounds[0] != 0) return 0;
  for (int64_t d = 0; d < docs; ++d)
    if (bounds[d + 1] <= bounds[d]) return 0;
  /* Work sums stay within 64 bits: S (S + 1) < 2^63. */
  return bounds[docs] >= ranks && bounds[docs] <= ((int64_t)1 << 31);
}

int cplib_document_placement(const int64_t* bounds, int64_t docs, int64_t ranks,
                             cplib_placed_piece* out, int64_t* count) {
  if (!bounds_valid(bounds, docs, ranks) || out == NULL || count == NULL) return CPLIB_EINVAL;
  const int64_t s = bounds[docs];
  doc_len* order = malloc(sizeof(doc_len) * (size_t)docs);
  int64_t* vstart = malloc(sizeof(int64_t) * (size_t)(docs + 1));
  int64_t* prefix = malloc(sizeof(int64_t) * (size_t)(docs + 1));
  share* shares = malloc(sizeof(share) * (size_t)(docs + 2 * ranks + 2));
  int status = CPLIB_ENOMEM;
  if (order == NULL || vstart == NULL || prefix == NULL || shares == NULL) goto done;
  for (int64_t d = 0; d < docs; ++d) order[d] = (doc_len){bounds[d + 1] - bounds[d], d};
  qsort(order, (size_t)docs, sizeof(doc_len), longest_first);
  vstart[0] = prefix[0] = 0;
  for (int64_t i = 0; i < docs; ++i) {
    vstart[i + 1] = vstart[i] + order[i].len;
    prefix[i + 1] = prefix[i] + order[i].len * (order[i].len + 1);
  }
  const virtual_seq v = {docs, s, order, vstart, prefix};
  int64_t front = 0, back = s, n = 0;
  wide acc = 0;
  for (int64_t r = 0; r < ranks; ++r) {
    const int64_t c = s / ranks + (r < s % ranks ? 1 : 0);
    if (r == ranks - 1) {
      add_run(&v, front, back, r, shares, &n);
      break;
    }
    const int64_t h = head_length(&v, front, back, c, (wide)prefix[docs] * c, &acc);
    add_run(&v, front, front + h, r, shares, &n);
    add_run(&v, back - (c - h), back, r, shares, &n);
    front += h;
    back -= c - h;
  }
  qsort(shares, (size_t)n, sizeof(share), by_doc_then_share);
  *count = cut_documents(bounds, shares, n, out);
  qsort(out, (size_t)*count, sizeof(cplib_placed_piece), by_rank_then_start);
  status = CPLIB_OK;
done:
  free(order);
  free(vstart);
  free(prefix);
  free(shares);
  return status;
}
