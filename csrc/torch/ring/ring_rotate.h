// Moving k/v blocks and their gradients between ranks. A block travels as
// one buffer, its k then its v (packed once per op), and a block's gradient
// as one buffer, its dk then its dv: one collective per step each way.
// "p2p" and "alltoall" fetch each step's block directly from its owner: at
// step s rank r sends its own block to r + offset(s) and receives the block
// of r - offset(s). "p2p" does it with one send and one receive, batched
// (send_recv: only the two peers take part); "alltoall" with one split
// all-to-all that every rank joins (torch's rotation). A message is non-empty
// only when its receiver attends that block (the plan tells every rank which
// ones), so windows and documents cut the traffic as well as the compute.
// Gradients of a visiting block go straight back to its owner. "allgather"
// gathers every block up front (padded to the longest shard) and
// reduce-scatters gradients at the end: one collective cannot leave blocks
// out, so it moves all of them.
#pragma once

#include <array>
#include <vector>

#include "comm/collectives.h"
#include "common/stable.h"

#include "common/aten.h"
#include "ring/ring.h"
#include "ring/ring_plan.h"

// Internal to the extension (torch's stable types are hidden).
#pragma GCC visibility push(hidden)

namespace cplib::ring {

// A block's k and v parts.
using KV = std::array<Tensor, 2>;

// Where a block's k and v sit in one flat buffer: k's elements, then v's,
// each contiguous, for a block of any number of rows.
class Packing {
 public:
  Packing(const Tensor& k, const Tensor& v);
  // Elements of part p (0 = k, 1 = v) of a block of `len` rows, and of both.
  int64_t numel(int p, int64_t len) const { return row_numel_[p] * len; }
  int64_t total(int64_t len) const { return numel(0, len) + numel(1, len); }
  // Part p's sizes for a block of `len` rows.
  std::vector<int64_t> sizes(int p, int64_t len) const;
  // The k and v of a `len`-row block packed in `buf` from element `offset`
  // (internal views: see aten::reinterpret).
  KV views(const Tensor& buf, int64_t len, int64_t offset = 0) const;
  // The first `len` rows of each part of a block packed for `longest` rows.
  KV views_padded(const Tensor& buf, int64_t len, int64_t longest, int64_t offset) const;

 private:
  std::array<std::vector<int64_t>, 2> sizes_;  // with dim 2 as given
  std::array<int64_t, 2> row_numel_;
};

// The k/v blocks of the forward (and of the backward's recomputation).
class BlockRing {
 public:
  // `k` and `v` are this rank's; they are sent (packed into one buffer once)
  // but never written.
  BlockRing(const Config& cfg, const RingPlan& plan, const Tensor& k, const Tensor& v);
  // The block of step s (undefined when this rank does not receive it);
  // posts the exchange of step s+1 first, so it is in flight while step s
  // computes. Call with s = 0, 1, ... in order. The parts are internal views.
  KV fetch(int64_t s);
  // Waits for whatever is still in flight and releases the p2p buffers.
  void finish();
  // p2p / alltoall: the flat buffer step s's block arrived in (undefined for
  // step 0, for "allgather" and when nothing arrived).
  Tensor arrived(int64_t s) const;

 private:
  void post(int64_t s);
  // Our k|v in one buffer for `longest` rows (padding left unwritten), made once.
  const Tensor& packed(int64_t longest);
  // The rows `ranges` of our k|v packed in a fresh buffer (what step's
  // receiver reads of our block).
  Tensor packed_rows(const std::vector<Range>& ranges, int64_t count) const;

  const Config& cfg_;
  const RingPlan& plan_;
  KV local_;
  Packing pack_;
  Tensor packed_;
  // p2p / alltoall: the received blocks (flat, fresh from the exchange):
  // step s's block and step s+1's, in flight; never more.
  std::array<Tensor, 2> buf_;
  Tensor gathered_;                          // allgather: N padded packed blocks, rank-major
  std::array<std::vector<Tensor>, 2> recv_;  // unwaited exchange outputs
};

// Gradient accumulators (accumulator dtype). Step s's block gradient (of
// the rows that travelled, see RingPlan::recv_rows) goes back to its owner
// after step s; a rank's own accumulator starts as its
// step-0 gradient and adds what the others send back. Besides it, one
// buffer each way, dK and dV packed in it: a step's gradient is written
// into the send buffer (or into the buffer its block arrived in, see
// reuse) once the previous step's has left it (it had the next step's
// compute to go), and the gradient returned at step s is added to ours, and
// its buffer released, before step s+1 computes: during a block's kernels
// this rank holds its own accumulator and at most one gradient in flight.
class GradRing {
 public:
  // `acc`: the accumulators' dtype. A visiting block's gradient travels in
  // grad_wire_dtype's.
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
  // Offers `spent`, the flat buffer step s's block arrived in, to hold step
  // s's gradient: call once step s's kernels no longer read the block. Used
  // when its dtype is the wire's (then the gradient has the block's exact
  // size), so that no separate send buffer is held through the kernels;
  // otherwise ignored.
  void reuse(int64_t s, const Tensor& spent);

 private:
  KV& slot(int64_t s);

  const Config& cfg_;
  const RingPlan& plan_;
  Packing pack_;
  int64_t own_len_;
  aten::Opts opts_;  // the accumulators'
  aten::Opts wire_;  // what a visiting block's gradient travels in
  KV own_;
  Tensor send_;     // packed dk|dv, flat, longest block; allocated on first use
  Tensor sending_;  // what holds send_step_'s gradient: send_, or a spent block
  Tensor spent_;    // the block buffer offered for spent_step_'s gradient
  int64_t spent_step_ = -1;
  Tensor recv_;              // packed, what the last pass brought back (fresh)
  int64_t recv_step_ = -1;   // the step whose gradient recv_ holds (its rows: send_rows)
  int64_t send_step_ = -1;   // the step whose gradient send_ holds
  bool send_fresh_ = false;  // send_ belongs to send_step_ but nothing is written yet
  bool recv_full_ = false;   // recv_ holds (or is receiving) a gradient not yet absorbed
  bool own_fresh_ = true;
  KV view_;
  Tensor all_;  // allgather: every block's partial gradient, packed and padded, rank-major
  std::vector<Tensor> pending_;  // unwaited exchange outputs (each sends and receives)
};

// The dtype a visiting block's gradient travels in (p2p and alltoall). In
// a ring whose only mask is causal, with a derived layout (no documents, no
// window, no explicit positions), every step is one call (ring_plan.h), so
// each row of the block's gradient has one contribution: with fp16/bf16
// inputs it travels in their dtype, as the kernel gave it (its GQA groups
// summed in fp32 and rounded once), half the bytes of the accumulator's, and
// its owner adds it into its fp32 accumulator. Otherwise (a step's calls may
// add to one row; or fp32/fp64 inputs) the accumulator's dtype.
ScalarType grad_wire_dtype(const Config& cfg, ScalarType input, ScalarType acc);

// Bytes this process has sent around rings since the last reset (a debug
// counter for tests: it shows what GQA, windows and documents save).
int64_t bytes_sent(bool reset);
// Adds to that counter (the pass-Q ring's messages).
void count_bytes_sent(int64_t bytes);

// Waits for every exchange output in `outs` and clears it.
void wait_all(std::vector<Tensor>& outs);

// One message exchange (cfg.rotate's: a batched send/recv for "p2p", else a
// split all-to-all), which every rank calls at the same point: `send` (if
// defined; contiguous) to rank `dst`, and `recv_numel` elements (if
// positive) from rank `src`. Returns the received elements, flat, in `opts` (undefined
// when nothing is received), unwaited; its output also goes to `pending`
// (wait for it before reading, or before writing `send` again).
Tensor exchange(const Config& c, const Tensor& send, int64_t dst, int64_t recv_numel, int64_t src,
                const aten::Opts& opts, std::vector<Tensor>& pending);

}  // namespace cplib::ring

#pragma GCC visibility pop
