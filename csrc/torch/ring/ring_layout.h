// Where a rank's shard sits in the global sequence. The sequence of S tokens
// is cut into C chunks whose sizes differ by at most one (the first S % C
// chunks get the extra token); sequential sharding gives rank r chunk r of N,
// head-tail sharding chunks r and 2N-1-r of 2N, and per-document head-tail
// sharding does that inside every document (chunks r and 2N-1-r of each), and
// an explicit layout lists every rank's positions. Every rank can compute every
// rank's pieces from (S, N, layout) alone, so uneven shards need no padding
// and no exchange of lengths. The document placement (ring_placement.h) is
// such a layout too: its pieces come from cu_seqlens and N alone. Where no
// layout derives them (non-causal
// attention over joint text+image shards), a layout carries every rank's
// length explicitly: rank r then holds the r-th run of a sequential cut.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

// Internal to the extension (torch's stable types are hidden).
#pragma GCC visibility push(hidden)

namespace cplib::ring {

// Global positions [start, start + len).
struct Range {
  int64_t start = 0, len = 0;
  int64_t end() const { return start + len; }
  bool empty() const { return len <= 0; }
};

// A contiguous run of a shard: its global range and its first local row.
struct Piece {
  Range global;
  int64_t local = 0;
};

// Chunk c of `chunks` chunks of a sequence of `seq_len` tokens.
Range chunk_range(int64_t seq_len, int64_t chunks, int64_t c);

struct Layout {
  int64_t seq_len = 0, size = 1;
  bool head_tail = false;
  std::vector<int64_t> documents;  // per-document head-tail: cu_seqlens; else empty
  std::vector<int64_t> lengths;    // explicit per-rank lengths (rank order); else empty
  // Explicit layout: every rank's global positions in local order (then
  // seq_len, head_tail and documents are unused). The derived layouts above
  // are the ways of computing these that need no exchange.
  std::vector<std::vector<int64_t>> positions;
  bool is_explicit() const { return !positions.empty(); }
  // Document placement (ring_placement.h): every rank's pieces, each inside
  // one document; null otherwise.
  std::shared_ptr<const std::vector<std::vector<Range>>> placed;

  // The non-empty pieces of `rank`'s shard in local order (one or two; two
  // per document with a per-document layout).
  std::vector<Piece> pieces(int64_t rank) const;
  int64_t local_len(int64_t rank) const;
  int64_t max_local_len() const;
};

}  // namespace cplib::ring

#pragma GCC visibility pop
