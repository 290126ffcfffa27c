// What a ring forward agreed, between its handshake and its first exchange:
// every rank's lengths and explicit positions, the documents' bounds and the
// CUDA backend. The backward that the forward's handshake covers (autograd's)
// takes all of it from the forward, as a record, instead of reading its
// inputs again: it re-checks nothing on its own (a check failing on one rank
// only would leave the others waiting in its ring) and communicates nothing
// before its ring.
#pragma once

#include <vector>

#include "attention/block.h"
#include "common/stable.h"
#include "ring/ring.h"

// Internal to the extension (torch's stable types are hidden).
#pragma GCC visibility push(hidden)

namespace cplib::ring {

struct Agreed {
  // The group as the forward resolved it (its rank, size, backend and
  // token): the backward asks Python for none of it again.
  int64_t rank = 0, size = 1, nccl = 0, token = 0;
  int64_t backend = attention::kBackendAuto;  // as resolved (auto on CPU)
  std::vector<int64_t> lengths;  // rank-major {q rows, k/v rows}; empty when not exchanged
  bool has_bounds = false;
  std::vector<int64_t> bounds;  // cu_seqlens as read
  // Explicit layouts: every rank's q and k/v positions (empty otherwise).
  std::vector<std::vector<int64_t>> q_positions, kv_positions;

  // As a 1-D int64 CPU tensor (what autograd keeps between the two ops), and back.
  Tensor to_record() const;
  static Agreed from_record(const Tensor& record);
  // The group named `name` as the forward resolved it.
  Group group(const std::string& name) const { return Group{name, rank, size, nccl != 0, token}; }
};

// After check_args, before the ring: with explicit positions gathers every
// rank's positions (one small all-gather of integers in host memory, over
// the group's handshake route; `lengths` are the handshake's {q rows, k/v
// rows} per rank, gathered too when empty), fills the layouts and completes
// the mask; resolves the CUDA backend alike on every rank
// (resolve_ring_backend) and ring_pass ("auto" from the global counts).
// With `agreed` (a covered backward) all of that is the forward's. The pass
// of the last call is kept for ring_debug_last_pass.
void finish_config(Config& cfg, const RingCall& call, const Tensor& q, const Tensor& k,
                   const Tensor& v, std::vector<int64_t> lengths, const Agreed* agreed = nullptr);
Pass last_ring_pass();

// The backend of every block of this ring: `cfg.backend` itself, or for auto
// (CUDA) the one scaled_dot_product_attention would pick for blocks of the
// longest shards every rank knows of (the layouts), with q's heads, head dims,
// dtype and device. From inputs every rank agrees on, so every rank resolves
// the same backend (or raises the same NotImplementedError) before the first
// exchange, whatever its own shard holds (none at all, with positions).
int64_t resolve_ring_backend(const Config& cfg, const Tensor& q, const Tensor& k, const Tensor& v);
// The block shape it resolves from (on every device; the same on every rank).
attention::BlockShape ring_block_shape(const Config& cfg, const Tensor& q, const Tensor& k,
                                       const Tensor& v);
// That shape for the last finish_config of this thread: {batch, heads, q
// rows, k/v rows, head dim, v head dim} (ring_debug_block_shape).
std::vector<int64_t> last_block_shape();

// What finish_config agreed, for the record.
Agreed agreed_of(const Config& cfg, const RingCall& call, std::vector<int64_t> lengths);

}  // namespace cplib::ring

#pragma GCC visibility pop
