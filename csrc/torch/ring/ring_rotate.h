// Moving k/v blocks and their gradients between ranks. A block travels as
// its k and v parts (two messages, sent straight from the inputs, never
// packed). "p2p" and "alltoall" fetch each step's block directly from its
// owner: at step s rank r sends its own block to r + offset(s) and receives
// the block of r - offset(s), both in one split all-to-all that every rank
// joins (torch's functional collectives, on every group); a message is
// non-empty only when its receiver attends that block (the plan tells every
// rank which ones), so windows and documents cut the traffic as well as the
// compute. Gradients of a visiting
// block go straight back to its owner. "allgather" gathers every block up
// front (padded to the longest shard) and reduce-scatters gradients at the
// end: one collective cannot leave blocks out, so it moves all of them.
#pragma once

#include <array>
#include <vector>

#include "comm/collectives.h"
#include "common/stable.h"

#include "ring/ring.h"
#include "common/aten.h"
#include "ring/ring_plan.h"

// Internal to the extension (torch's stable types are hidden).
#pragma GCC visibility push(hidden)

namespace cplib::ring {

// A block's k and v parts.
using KV = std::array<Tensor, 2>;

// The k/v blocks of the forward (and of the backward's recomputation).
class BlockRing {
 public:
  // `local` is this rank's k and v (contiguous); they are sent but never written.
  BlockRing(const Config& cfg, const RingPlan& plan, KV local);
  // The block of step s (undefined when this rank does not receive it);
  // posts the exchange of step s+1 first, so it is in flight while step s
  // computes. Call with s = 0, 1, ... in order.
  KV fetch(int64_t s);
  // Waits for whatever is still in flight and releases the p2p buffers.
  void finish();

 private:
  void post(int64_t s);

  const Config& cfg_;
  const RingPlan& plan_;
  KV local_;
  // p2p / alltoall: the received blocks (flat, fresh from the exchange):
  // step s's block and step s+1's, in flight; never more.
  std::array<KV, 2> buf_;
  KV gathered_;            // allgather: [N * longest block] per part, rank-major
  std::array<std::vector<Tensor>, 2> recv_;  // unwaited exchange outputs
};

// Gradient accumulators (accumulator dtype). Step s's block gradient goes
// back to its owner after step s; a rank's own accumulator starts as its
// step-0 gradient and adds what the others send back. Besides it, one
// buffer each way: a step's gradient is written into the send buffer once
// the previous step's has left it (it had the next step's compute to go),
// and the gradient returned at step s is added to ours, and its buffer
// released, before step s+1 computes: during a block's kernels this rank
// holds its own accumulator and at most one gradient in flight.
class GradRing {
 public:
  GradRing(const Config& cfg, const RingPlan& plan, const Tensor& k, const Tensor& v,
           ScalarType acc);
  // Adds step s's block gradients (q's heads, summed over each GQA group)
  // into rows [start, start + len) of that block's accumulator.
  void add(int64_t s, const Tensor& gk, const Tensor& gv, int64_t start, int64_t len);
  // Sends step s's gradient to its owner, after step s's contributions.
  void pass(int64_t s);
  // Adds the gradient of our block that the last pass brought back and
  // releases its buffer; called before each step's compute.
  void settle();
  // This rank's own block's (dk, dv), once every step has passed.
  KV result();

 private:
  KV& slot(int64_t s);

  const Config& cfg_;
  const RingPlan& plan_;
  std::array<std::vector<int64_t>, 2> sizes_;  // of our k and v
  aten::Opts opts_;
  KV own_;
  KV send_;                   // flat, longest block; allocated on first use
  KV recv_;                   // flat, what the last pass brought back (fresh)
  int64_t send_step_ = -1;    // the step whose gradient send_ holds
  bool send_fresh_ = false;   // send_ belongs to send_step_ but nothing is written yet
  bool recv_full_ = false;    // recv_ holds (or is receiving) a gradient not yet absorbed
  bool own_fresh_ = true;
  KV view_;
  KV all_;  // allgather: every block's partial gradient, padded, reduce-scattered at the end
  std::vector<Tensor> pending_;  // unwaited exchange outputs (each sends and receives)
};

// Bytes this process has sent around rings since the last reset (a debug
// counter for tests: it shows what GQA, windows and documents save).
int64_t bytes_sent(bool reset);
// Adds to that counter (the pass-Q ring's messages).
void count_bytes_sent(int64_t bytes);

// Waits for every exchange output in `outs` and clears it.
void wait_all(std::vector<Tensor>& outs);

// One message exchange, a split all-to-all that every rank joins: `send`
// (if defined) to rank `dst`, and `recv_numel` elements (if positive) from
// rank `src`. Returns the received elements, flat, in `opts` (undefined
// when nothing is received), unwaited; its output also goes to `pending`
// (wait for it before reading, or before writing `send` again).
Tensor exchange(const Config& c, const Tensor& send, int64_t dst, int64_t recv_numel, int64_t src,
                const aten::Opts& opts, std::vector<Tensor>& pending);

}  // namespace cplib::ring

#pragma GCC visibility pop
