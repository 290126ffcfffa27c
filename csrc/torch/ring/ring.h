// Ring scaled-dot-product attention: shared types of the ring_*.cpp files.
// The call's arguments and the names of its choices are in ring_call.h.
#pragma once

#include <optional>
#include <string_view>

#include "attention/block.h"
#include "comm/collectives.h"
#include "common/stable.h"
#include "ring/ring_call.h"
#include "ring/ring_layout.h"
#include "ring/ring_mask.h"

// Internal to the extension (torch's stable types are hidden).
#pragma GCC visibility push(hidden)

namespace cplib::ring {

// Everything a ring pass needs besides the tensors; built by check_args.
// Its blocks run as attention::BlockConfig says (causal, scale, backend,
// GQA groups, CUDA), which it extends with the ring's own.
struct Config : attention::BlockConfig {
  Group group;
  int64_t rank = 0, size = 1;
  SeqLayout layout = SeqLayout::sequential;
  Rotate rotate = Rotate::p2p;
  Layout q_layout, kv_layout;  // where every rank's q and k/v rows sit globally
  Mask mask;                   // causal, documents, window, in global positions
  bool pass_q = false;         // queries travel, k/v stay (forward only)
};

// Validates every argument (ValueError naming the value) against the group,
// resolved once per op by the caller (each resolution is a call into
// Python); nothing is communicated, so every rank fails the same way.
Config check_args(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                  const Group& group, const RingCall& call);

// cu_seqlens' values checked: [0, ..., seq_len], strictly increasing
// (ValueError naming them).
void check_bounds(const char* op, const std::vector<int64_t>& bounds, int64_t seq_len);

// The q and k/v layouts and the mask of a ring over cfg.size ranks of sq
// query and sk key tokens, from cfg.layout, cfg.causal and the documents in
// cfg.mask.bounds (checked): what check_args builds, and what
// ring_plan_summary (ring_plan_summary.cpp) plans with.
void lay_out(const char* op, Config& cfg, int64_t sq, int64_t sk,
             const std::optional<std::vector<int64_t>>& window);

// ring_pass="auto": "q" (true) when passing the queries and returning the
// partial (out, lse) moves fewer bytes than passing k and v, from the global
// query and key counts, the head counts and head dims.
bool pass_q_moves_less(int64_t q_tokens, int64_t kv_tokens, int64_t q_heads, int64_t kv_heads,
                       int64_t head_dim, int64_t v_head_dim, int64_t elem_size, int64_t acc_size);

}  // namespace cplib::ring

#pragma GCC visibility pop
