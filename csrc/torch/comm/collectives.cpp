#include "comm/collectives.h"

namespace cplib {

Group resolve_group(std::string_view group_name) {
  const std::string name(group_name);
  // cplib_c::group_info is implemented in Python (cplib/comm/native.py): the
  // stable ABI has no process-group API. It returns [] for an unknown name.
  auto stack = call("cplib_c::group_info", "", name);
  const auto info = ret<std::vector<int64_t>>(stack[0]);
  CPLIB_CHECK_VALUE(info.size() == 4, "cplib: no process group is registered under the name '",
                    name,
                    "' (destroyed, or never initialised: pass group.group_name of a live "
                    "group)");
  return Group{name, info[0], info[1], info[2] != 0, info[3]};
}

Tensor all_gather_dim0(const Group& g, const Tensor& in) {
  auto stack = call("cplib_c::c10d_all_gather", "", in, g.size, g.name);
  return ret<Tensor>(stack[0]);
}

Tensor reduce_scatter_sum_dim0(const Group& g, const Tensor& in) {
  auto stack = call("cplib_c::c10d_reduce_scatter_sum", "", in, g.size, g.name);
  return ret<Tensor>(stack[0]);
}

Tensor all_to_all_dim0(const Group& g, const Tensor& in) {
  const int64_t rows = in.size(0) / g.size;
  std::vector<int64_t> even(static_cast<size_t>(g.size), rows);
  return all_to_all_split(g, in, even, even);
}

Tensor all_to_all_split(const Group& g, const Tensor& in, const std::vector<int64_t>& out_splits,
                        const std::vector<int64_t>& in_splits) {
  auto stack = call("cplib_c::c10d_all_to_all", "", in, out_splits, in_splits, g.name);
  return ret<Tensor>(stack[0]);
}

Tensor send_recv(const Group& g, const Tensor& in, int64_t dst, int64_t recv_numel, int64_t src) {
  auto stack = call("cplib_c::c10d_send_recv", "", in, dst, recv_numel, src, g.name);
  return ret<Tensor>(stack[0]);
}

void wait(const Tensor& t) {
  // The op returns an alias of `t`: take it, so that its handle is released.
  auto stack = call("_c10d_functional::wait_tensor", "", t);
  (void)ret<Tensor>(stack[0]);
}

// The stable ABI has no process-group API, and torch's functional
// collectives take the group as `Any` from torch 2.13 on, a type the stable
// dispatcher call cannot pass; these ops take it as `str` and are
// implemented in Python (cplib/comm/native.py: group_info; the others in
// cplib/comm/collectives.py), on the group's own calls.
STABLE_TORCH_LIBRARY_FRAGMENT(cplib_c, m) {
  // [rank, size, NCCL?, token] of a group, or [] for an unknown name.
  m.def("group_info(str group_name) -> int[]");
  m.def("c10d_all_gather(Tensor input, int group_size, str group_name) -> Tensor");
  m.def("c10d_reduce_scatter_sum(Tensor input, int group_size, str group_name) -> Tensor");
  m.def(
      "c10d_all_to_all(Tensor input, int[] output_split_sizes, int[] input_split_sizes, "
      "str group_name) -> Tensor");
  m.def(
      "c10d_send_recv(Tensor input, int dst, int recv_numel, int src, str group_name) "
      "-> Tensor");
}

}  // namespace cplib
