/* Document placement: where the tokens of a packed sequence go across the
 * ranks of a context-parallel group, so that
 *   - every rank gets the same number of tokens (S / N; the first S % N
 *     ranks one more when N does not divide S),
 *   - a document that the balance does not need to cut stays whole on one
 *     rank (its keys never travel),
 *   - a document that is cut is cut head-tail: each of its ranks gets a
 *     front chunk and the mirrored back chunk, so the causal work of a share
 *     of t tokens of a document of L tokens is t (L + 1) / 2 whatever the
 *     share's size,
 *   - the causal work (query-key pairs) per rank is balanced.
 *
 * The algorithm: the documents, longest first, form a virtual sequence V
 * whose token density (work per token, (L + 1) / 2) decreases. Rank r takes
 * a head run of V and a tail run (head-tail over the density order), its
 * head length h_r chosen so that its work is the target (work(h) grows with
 * h). Each cut falls inside at most one document; a head cut is moved onto a
 * document boundary when that keeps the rank's work, and the running sum of
 * every rank's deviation, within 2% of its target (the tail cut then absorbs
 * the token count: the tail holds the shortest documents). So at most
 * 2 (N - 1) documents are cut, the long ones where the balance needs it
 * and short ones to make the token counts exact.
 *
 * Integer arithmetic only: every rank computes the same placement. */
#ifndef CPLIB_PLACEMENT_H
#define CPLIB_PLACEMENT_H

#include "cplib/types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One contiguous run of global positions [start, start + len) on `rank`. */
typedef struct {
  int64_t rank, start, len;
} cplib_placed_piece;

/* The most pieces a placement of `docs` documents over `ranks` ranks has. */
int64_t cplib_placement_max_pieces(int64_t docs, int64_t ranks);

/* Places the documents of `bounds` ([0, s1, ..., S], `docs` + 1 strictly
 * increasing entries) on `ranks` ranks (S >= ranks >= 1). Writes the pieces
 * to `out` (room for cplib_placement_max_pieces), sorted by rank and then by
 * global start (a rank's local order), and their number to `count`. Every
 * piece lies inside one document. Returns CPLIB_OK, or CPLIB_EINVAL for bad
 * bounds, or CPLIB_ENOMEM when scratch memory cannot be allocated. */
int cplib_document_placement(const int64_t* bounds, int64_t docs, int64_t ranks,
                             cplib_placed_piece* out, int64_t* count);

#ifdef __cplusplus
}
#endif
#endif
