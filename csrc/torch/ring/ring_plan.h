// The ring's schedule in global positions. Step 0 attends the local block;
// step s > 0 attends the block of rank (rank - offset(s)) mod N. Only the
// offsets some rank can use are visited, so a window of W tokens costs about
// 2 W / L steps, not N - 1. Each step is a short list of calls (q rows x
// block rows), each with no mask, the causal diagonal, or an explicit mask.
// With "p2p" / "alltoall" and a derived layout, a step's block travels as
// only the rows some call of its receiver reads (documents, windows): the
// plan lists them for both ends, and its calls index the rows received.
#pragma once

#include <memory>
#include <vector>

#include "ring/ring.h"

// Internal to the extension (torch's stable types are hidden).
#pragma GCC visibility push(hidden)

namespace cplib::ring {

struct Call {
  Visibility kind = Visibility::full;  // full, causal or partial
  int64_t q_local = 0, q_len = 0;      // rows of the local q
  int64_t k_local = 0, k_len = 0;      // rows of the visiting block
  int64_t q_global = 0, k_global = 0;  // their first global positions (for the mask)
  // Explicit layouts: the ranks whose q rows and k/v rows these are (the
  // mask is then read on their positions).
  int64_t q_rank = -1, k_rank = -1;
  Range q() const { return {q_global, q_len}; }
  Range k() const { return {k_global, k_len}; }
};

class RingPlan {
 public:
  // The rows of a block that a receiver's calls read (see recv_rows).
  struct Rows {
    std::vector<Range> ranges;
    int64_t count = 0;
  };
  // What the plan computes: the same for every op call of one configuration
  // (a batch's layers, forward and backward), so it is cached per thread on
  // the values it depends on (the layouts, the mask, rank, size, rotation).
  struct Tables {
    std::vector<int64_t> offsets;
    std::vector<char> needs;               // [offset * size + rank]
    std::vector<std::vector<Call>> calls;  // per step
    std::vector<Rows> recv, send;          // per step
  };

  explicit RingPlan(const Config& cfg);
  int64_t steps() const { return static_cast<int64_t>(t_->offsets.size()); }
  int64_t offset(int64_t s) const { return t_->offsets[s]; }
  // The rank whose block step s attends, and the rank that attends ours.
  int64_t source(int64_t s) const;
  int64_t target(int64_t s) const;
  // Whether this rank receives step s's block, and sends its own at step s.
  bool receives(int64_t s) const { return needs(cfg_.rank, t_->offsets[s]); }
  bool sends(int64_t s) const { return needs(target(s), t_->offsets[s]); }
  int64_t kv_len(int64_t rank) const { return cfg_.kv_layout.local_len(rank); }
  // The rows of step s's block this rank receives (and its calls index),
  // and the rows of its own block it sends at step s: local row ranges of
  // the sender's block, merged and ascending; empty for the whole block.
  const std::vector<Range>& recv_rows(int64_t s) const { return t_->recv[s].ranges; }
  const std::vector<Range>& send_rows(int64_t s) const { return t_->send[s].ranges; }
  int64_t recv_len(int64_t s) const { return t_->recv[s].count; }
  int64_t send_len(int64_t s) const { return t_->send[s].count; }
  // This rank's calls at step s (k rows: of the block as received).
  const std::vector<Call>& calls(int64_t s) const { return t_->calls[s]; }
  // The calls of q rows of `q_rank` against the k/v block of `kv_rank` (pass-Q).
  std::vector<Call> calls_between(int64_t q_rank, int64_t kv_rank) const {
    return plan_pair(q_rank, kv_rank, /*any_only=*/false);
  }
  // The additive mask and the rows that see no key of a partial call.
  std::pair<Tensor, Tensor> mask(const Call& c, const aten::Opts& opts) const;

 private:
  bool needs(int64_t rank, int64_t offset) const;
  std::shared_ptr<const Tables> build() const;
  std::vector<Call> plan_pair(int64_t rank, int64_t src, bool any_only) const;
  std::vector<Call> plan_explicit(int64_t rank, int64_t src, bool any_only) const;
  // Calls of classified cells (q piece x k piece, row-major), marked done.
  void causal_runs(const std::vector<Visibility>& cls, const std::vector<Piece>& qp,
                   const std::vector<Piece>& kp, std::vector<char>& done,
                   std::vector<Call>& calls) const;
  void full_rectangles(const std::vector<Visibility>& cls, const std::vector<Piece>& qp,
                       const std::vector<Piece>& kp, std::vector<char>& done,
                       std::vector<Call>& calls) const;
  Rows rows_read(const std::vector<Call>& calls, int64_t len, bool compact) const;

  const Config& cfg_;
  std::vector<char> kv_sorted_;  // explicit layouts: rank's k/v positions ascending
  std::shared_ptr<const Tables> t_;
};

}  // namespace cplib::ring

#pragma GCC visibility pop
