// Check mode: before a communicating op's first collective, every rank
// all-gathers a short description of its call (shapes, dtypes, flags, hashes
// of small integer tensors) and all raise the same ValueError when they
// disagree, instead of one rank raising and the others waiting in a
// collective until the process-group timeout.
//
// On when TORCH_DISTRIBUTED_DEBUG=DETAIL (torch's convention) or
// CPLIB_CHECK_CONSISTENCY=1; it costs one small all-gather per call.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "comm/comm.h"

namespace cplib {

bool consistency_checks_enabled();

// Named integers that must be equal on every rank of the group.
class CallSignature {
 public:
  void add(std::string name, int64_t value);
  // Rank, sizes, dtype and device type of `t` (or "undefined").
  void add_meta(const std::string& name, const at::Tensor& t);
  // A 64-bit hash of the values of an integer tensor (cu_seqlens, say).
  void add_values_hash(const std::string& name, const at::Tensor& t);

  const std::vector<std::pair<std::string, int64_t>>& fields() const { return fields_; }

 private:
  std::vector<std::pair<std::string, int64_t>> fields_;
};

// All-gathers `sig` over `pg` (buffers on `device`) and raises ValueError on
// every rank, naming the first field that differs and its value on each rank.
void check_consistent(const PG& pg, std::string_view op, const CallSignature& sig,
                      const at::Device& device);

// check_consistent, only when consistency_checks_enabled().
inline void maybe_check_consistent(const PG& pg, std::string_view op, const CallSignature& sig,
                                   const at::Device& device) {
  if (consistency_checks_enabled()) check_consistent(pg, op, sig, device);
}

}  // namespace cplib
