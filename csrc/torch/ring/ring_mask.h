// The attention mask of a ring in global positions: query i sees key j iff
//   i - left <= j <= i + right      (the window; causal means right = 0)
//   and doc(i) == doc(j)            (documents from cu_seqlens, if any).
// Rectangles of (query rows x key rows) are classified so that a ring step
// computes nothing where nothing is visible, uses no mask where everything
// is, and builds an explicit mask only where it must.
#pragma once

#include <vector>

#include "common/aten.h"
#include "common/stable.h"

#include "ring/ring_layout.h"

// Internal to the extension (torch's stable types are hidden).
#pragma GCC visibility push(hidden)

namespace cplib::ring {

enum class Visibility { empty, full, causal, partial };

struct Mask {
  bool causal = false;
  int64_t seq_len = 0;          // S (the larger of q's and kv's)
  int64_t left = 0, right = 0;  // window sides, clamped to [0, S]; causal: right = 0
  std::vector<int64_t> bounds;  // cu_seqlens; empty: one document

  // No mask at all: every key visible from every query.
  bool dense() const;
  // `causal` means q == k and the mask restricted to it is exactly j <= i.
  Visibility classify(Range q, Range k) const;
  // The smallest range of keys within k that some query of q sees (may be empty).
  Range visible_keys(Range q, Range k) const;
  // (q.len, k.len) additive mask (0 or -inf) in `opts`' dtype on its device,
  // and the (q.len) boolean rows that see no key at all.
  std::pair<Tensor, Tensor> build(Range q, Range k, const aten::Opts& opts) const;
  // The same for explicit positions: the rows' and columns' global positions.
  std::pair<Tensor, Tensor> build_at(const std::vector<int64_t>& q_pos,
                                     const std::vector<int64_t>& k_pos,
                                     const aten::Opts& opts) const;

 private:
  int64_t doc_of(int64_t pos) const;  // index into bounds
  bool band_empty(Range q, Range k) const;
  bool band_full(Range q, Range k) const;
};

}  // namespace cplib::ring

#pragma GCC visibility pop
