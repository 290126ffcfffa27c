// Process groups and collectives on the stable ABI: a group is its registered
// name (with its rank and size, asked of the Python side once per call), and
// every collective is one of torch's functional collectives
// (_c10d_functional::*), reached through cplib_c::c10d_* (see
// collectives.cpp for why). They work with every registered group, the
// threaded test group included. Each returns its output unwaited: call wait()
// before reading it, and overlap compute in between.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/stable.h"

namespace cplib {

struct Group {
  std::string name;
  int64_t rank = 0;
  int64_t size = 1;
  bool nccl = false;  // its collectives take CUDA tensors
  // This process's number for the group object (cplib/comm/native.py:
  // group_token): never reused, unlike names after a new init.
  int64_t token = 0;
};

// Raises ValueError naming the group when nothing is registered under it.
Group resolve_group(std::string_view group_name);

// Dim-0 collectives of contiguous buffers.
Tensor all_gather_dim0(const Group& g, const Tensor& in);
Tensor reduce_scatter_sum_dim0(const Group& g, const Tensor& in);
Tensor all_to_all_dim0(const Group& g, const Tensor& in);
// Rows per peer (dim 0): `in_splits[r]` rows go to rank r, `out_splits[r]`
// come from it. One non-empty peer each way is a point-to-point exchange:
// the ring's shift, on every torch and every group (functional send/recv
// ops only exist from torch 2.13, and the threaded group has no send/recv).
Tensor all_to_all_split(const Group& g, const Tensor& in, const std::vector<int64_t>& out_splits,
                        const std::vector<int64_t>& in_splits);

// Waits for the collective that produced `t` (a no-op for any other tensor).
void wait(const Tensor& t);

}  // namespace cplib
