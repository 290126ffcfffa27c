// Process groups and collectives on the stable ABI: a group is its registered
// name (with its rank and size, asked of the Python side once per call), and
// every collective is a call of the process group's own (torch's functional
// collectives on torch's threaded test group), reached through
// cplib_c::c10d_* (see collectives.cpp for why) and registered with torch's
// work registry, so that _c10d_functional::wait_tensor waits for it. They
// work with every registered group. Each returns its output unwaited: call
// wait() before reading it, and overlap compute in between.
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
// come from it. Every rank of the group joins it.
Tensor all_to_all_split(const Group& g, const Tensor& in, const std::vector<int64_t>& out_splits,
                        const std::vector<int64_t>& in_splits);
// A neighbour exchange: the flat `in` (may be empty) to rank `dst`, and
// `recv_numel` elements of its dtype, on its device, from rank `src` (a flat
// output; empty when 0). Where the group has point-to-point calls (gloo,
// NCCL) it is one send and one receive, batched, that no other rank takes
// part in; on a group without them (torch's threaded test group), and for a
// group's first exchange (NCCL creates its communicator with every rank),
// the same split all-to-all with those two peers. Every rank of the group
// calls it at the same point, with nothing to send or receive too.
Tensor send_recv(const Group& g, const Tensor& in, int64_t dst, int64_t recv_numel, int64_t src);

// Waits for the collective that produced `t` (a no-op for any other tensor).
void wait(const Tensor& t);

}  // namespace cplib
