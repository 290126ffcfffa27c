#include "ring/ring_layout.h"

#include <algorithm>

namespace cplib::ring {

Range chunk_range(int64_t seq_len, int64_t chunks, int64_t c) {
  const int64_t base = seq_len / chunks, extra = seq_len % chunks;
  return {c * base + std::min(c, extra), base + (c < extra ? 1 : 0)};
}

std::vector<Piece> Layout::pieces(int64_t rank) const {
  std::vector<Piece> out;
  auto add = [&out](Range g) {
    if (g.empty()) return;
    const int64_t local = out.empty() ? 0 : out.back().local + out.back().global.len;
    out.push_back({g, local});
  };
  if (placed) {
    for (const Range& g : (*placed)[static_cast<size_t>(rank)]) add(g);
  } else if (!lengths.empty()) {
    int64_t start = 0;
    for (int64_t r = 0; r < rank; ++r) start += lengths[r];
    add({start, lengths[rank]});
  } else if (!documents.empty()) {
    for (size_t d = 0; d + 1 < documents.size(); ++d) {
      const int64_t start = documents[d], len = documents[d + 1] - documents[d];
      for (const int64_t c : {rank, 2 * size - 1 - rank}) {
        const Range r = chunk_range(len, 2 * size, c);
        add({start + r.start, r.len});
      }
    }
  } else if (!head_tail) {
    add(chunk_range(seq_len, size, rank));
  } else {
    add(chunk_range(seq_len, 2 * size, rank));
    add(chunk_range(seq_len, 2 * size, 2 * size - 1 - rank));
  }
  return out;
}

int64_t Layout::local_len(int64_t rank) const {
  if (is_explicit()) return static_cast<int64_t>(positions[rank].size());
  int64_t n = 0;
  for (const Piece& p : pieces(rank)) n += p.global.len;
  return n;
}

int64_t Layout::max_local_len() const {
  int64_t m = 0;
  for (int64_t r = 0; r < size; ++r) m = std::max(m, local_len(r));
  return m;
}

}  // namespace cplib::ring
