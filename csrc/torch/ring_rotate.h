// Moving k/v blocks and their gradient accumulators around the ring. Buffers
// are flat and contiguous; rank r sends to r+1 and receives from r-1, so at
// step i a rank holds the block that started on rank (r - i) mod N.
#pragma once

#include <array>
#include <vector>

#include <ATen/ATen.h>

#include "ring.h"

namespace cplib::ring {

// The k/v blocks of the forward (and of the backward's recomputation).
class BlockRing {
 public:
  // `local` is this rank's packed block; the ring takes it as its first buffer.
  BlockRing(const Config& cfg, at::Tensor local);
  // The block of step i; posts the exchange for step i+1 before returning,
  // so it is in flight while step i computes. Call with i = 0, 1, ... in order.
  at::Tensor fetch(int64_t i);
  // Waits for whatever is still in flight.
  void finish();

 private:
  const Config& cfg_;
  std::array<at::Tensor, 2> buf_;  // p2p / alltoall: double buffer
  at::Tensor gathered_;            // allgather: [N * numel], rank-major
  std::vector<WorkPtr> pending_;
};

// Gradient accumulators of the visiting blocks (accumulator dtype). The
// accumulator of the block a rank holds at step i is handed on with it, so
// after N steps each block's gradient is back on its owner.
class GradRing {
 public:
  GradRing(const Config& cfg, int64_t numel, const at::TensorOptions& opts);
  // Accumulator of step i's block (waits for it to arrive).
  at::Tensor at(int64_t i);
  // Sends step i's accumulator on, after step i's contributions.
  void pass(int64_t i);
  // This rank's own block's gradient, once every rank has passed its last step.
  at::Tensor result();

 private:
  const Config& cfg_;
  int64_t numel_;
  std::array<at::Tensor, 2> buf_;
  at::Tensor all_;  // allgather: every block's partial gradient, reduce-scattered at the end
  std::vector<WorkPtr> pending_;
};

// Bytes this process has sent around rings since the last reset (a debug
// counter for tests: it shows what GQA saves).
int64_t bytes_sent(bool reset);

}  // namespace cplib::ring
