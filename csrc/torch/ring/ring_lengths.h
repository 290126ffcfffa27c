// Every rank's local lengths, for ops whose ranks may hold blocks of
// different sizes (non-causal attention over joint streams: 33 text tokens
// over 2 ranks give joint shards of 145 and 144 rows).
#pragma once

#include <vector>

#include "comm/collectives.h"
#include "common/stable.h"
#include "ring/ring.h"

// Internal to the extension (torch's stable types are hidden).
#pragma GCC visibility push(hidden)

namespace cplib::ring {

// One small all-gather: `local` (the same count of values on every rank) from
// every rank, rank-major. Collective over `group`, in host memory over the
// group's handshake route (see comm/handshake.h); on `device` only for an
// NCCL group without a CPU side group.
std::vector<int64_t> gather_local_lengths(const Group& group, const std::vector<int64_t>& local,
                                          const Device& device);

// Without seq_len or documents the ring derives every rank's rows from equal
// shards; this reads the actual q and k/v lengths of every rank from `table`
// (rank-major {q rows, k/v rows}: a handshake's, or the forward's for a
// backward it covers; gathered into it when empty and needed, cleared when
// not needed) and, where they differ, gives the layouts explicit per-rank
// lengths (non-causal attention only: causal masks, windows, documents and
// load balancing need global positions, so they raise ValueError naming the
// lengths and seq_len, alike on every rank).
void learn_local_lengths(const char* op, Config& cfg, const Tensor& q, const Tensor& k,
                         const RingCall& call, std::vector<int64_t>& table);

}  // namespace cplib::ring

#pragma GCC visibility pop
