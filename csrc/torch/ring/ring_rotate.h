// Moving k/v blocks and their gradient accumulators around the ring. A block
// travels as its k and v parts (two messages, never packed into one buffer,
// so the local block is sent straight from the inputs); rank r sends to r+1
// and receives from r-1, so at step i a rank holds the block that started on
// rank (r - i) mod N.
#pragma once

#include <array>
#include <vector>

#include <ATen/ATen.h>

#include "ring/ring.h"

namespace cplib::ring {

// A block's k and v parts, each contiguous.
using KV = std::array<at::Tensor, 2>;

// The k/v blocks of the forward (and of the backward's recomputation).
class BlockRing {
 public:
  // `local` is this rank's k and v; they are sent but never written.
  BlockRing(const Config& cfg, KV local);
  // The block of step i; posts the exchange for step i+1 before returning,
  // so it is in flight while step i computes. Call with i = 0, 1, ... in order.
  KV fetch(int64_t i);
  // Waits for whatever is still in flight.
  void finish();

 private:
  const Config& cfg_;
  std::array<KV, 2> buf_;        // p2p / alltoall: double buffer
  bool slot0_is_local_ = true;   // slot 0 still holds the caller's k/v
  KV gathered_;                  // allgather: [N * numel] per part, rank-major
  std::vector<WorkPtr> pending_;
};

// Gradient accumulators (accumulator dtype) of the visiting blocks. The
// accumulator of the block a rank holds at step i is handed on with it, so
// after N steps each block's gradient is back on its owner. A rank's own
// accumulator starts as its first contribution, not as zeros.
class GradRing {
 public:
  GradRing(const Config& cfg, const at::Tensor& k, const at::Tensor& v, at::ScalarType acc);
  // Adds step i's block gradients (q's heads, summed over each GQA group)
  // into rows [start, start + len) of that block's accumulator.
  void add(int64_t i, const at::Tensor& gk, const at::Tensor& gv, int64_t start, int64_t len);
  // Sends step i's accumulator on, after step i's contributions.
  void pass(int64_t i);
  // This rank's own block's (dk, dv), once every rank has passed its last step.
  KV result();

 private:
  KV& slot(int64_t i);  // step i's accumulator, once it has arrived

  const Config& cfg_;
  std::array<std::vector<int64_t>, 2> sizes_;  // of k and v
  std::array<KV, 2> buf_;
  std::array<bool, 2> fresh_{false, false};  // allocated, not yet written
  KV all_;  // allgather: every block's partial gradient, reduce-scattered at the end
  KV view_;  // allgather: step i's block within all_
  std::vector<WorkPtr> pending_;
};

// Bytes this process has sent around rings since the last reset (a debug
// counter for tests: it shows what GQA saves).
int64_t bytes_sent(bool reset);

}  // namespace cplib::ring
