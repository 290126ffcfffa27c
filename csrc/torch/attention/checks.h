// The checks of one block of attention's arguments, which every feature
// running the block kernels makes before it computes (ValueError naming the
// value): q, k, v of shape (B, H, L, D) with one dtype and device, heads that
// divide (GQA), the backend, the scale, causal lengths.
#pragma once

#include <optional>

#include "attention/block.h"
#include "common/stable.h"

// Internal to the extension (torch's stable types are hidden).
#pragma GCC visibility push(hidden)

namespace cplib::attention {

// The checks, and the BlockConfig they give, with `backend` as passed (the
// ring resolves auto itself, from what every rank agrees on). `positions`:
// the caller places rows by explicit positions, so a rank may hold no q or
// k/v rows and causal needs no equal local lengths.
BlockConfig check_block_args(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                             bool is_causal, std::optional<double> scale, int64_t backend,
                             bool positions);

// The same for one call on these very tensors (Ulysses' local attention,
// decode's shard): auto resolved on their shapes.
BlockConfig check_local_args(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                             bool is_causal, std::optional<double> scale, int64_t backend);

// The scale the kernels get: `scale`, or for MLA (v's head dim differs from
// q's) SDPA's default for q's head dim, fixed here because some kernels see
// zero-padded q/k (block.cpp).
std::optional<double> block_scale(std::optional<double> scale, const Tensor& q, const Tensor& v);

}  // namespace cplib::attention

#pragma GCC visibility pop
