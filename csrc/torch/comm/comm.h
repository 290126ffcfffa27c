// Process-group access for cplib ops: resolve by name, and thin wrappers over
// the ProcessGroup calls the ops use, so the ops never touch c10d directly.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace cplib {

using PG = c10::intrusive_ptr<c10d::ProcessGroup>;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;

// Raises ValueError naming the group when nothing is registered under it.
PG resolve_group(std::string_view group_name);

// Groups implemented in Python (the threaded test group) only see the
// list-form collectives and the split all-to-all from C++; torch's threaded
// group has no send/recv.
bool python_group(const PG& pg);

// Collectives on dim 0 of contiguous buffers; each returns its Work unwaited.
WorkPtr all_gather_dim0(const PG& pg, at::Tensor& out, at::Tensor& in);
WorkPtr reduce_scatter_sum_dim0(const PG& pg, at::Tensor& out, at::Tensor& in);
WorkPtr all_to_all(const PG& pg, at::Tensor& out, at::Tensor& in);
// All-to-all of flat 1-D buffers with explicit per-rank element counts.
WorkPtr all_to_all_split(const PG& pg, at::Tensor& out, at::Tensor& in,
                         std::vector<int64_t>& out_splits, std::vector<int64_t>& in_splits);
WorkPtr send(const PG& pg, at::Tensor& t, int dst, int tag);
WorkPtr recv(const PG& pg, at::Tensor& t, int src, int tag);

inline void wait(const WorkPtr& w) {
  if (w) w->wait();
}

}  // namespace cplib
