#include "comm/comm.h"

#include <vector>

#include <c10/util/Exception.h>
#include <torch/version.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
// torch 2.14 moved the Python group's header into c10d/py/.
#if __has_include(<torch/csrc/distributed/c10d/py/PyProcessGroup.hpp>)
#include <torch/csrc/distributed/c10d/py/PyProcessGroup.hpp>
#else
#include <torch/csrc/distributed/c10d/PyProcessGroup.hpp>
#endif

// torch 2.13 renamed _allgather_base/_reduce_scatter_base/alltoall_base and
// kept the old names as deprecated aliases; the old names are the ones that
// exist in every torch cplib supports (2.11 - 2.15).
#if defined(__GNUC__)
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
#endif

namespace cplib {

PG resolve_group(std::string_view group_name) {
  const std::string name(group_name.data(), group_name.size());
  try {
    return c10d::resolve_process_group(name);
  } catch (const c10::Error&) {
    TORCH_CHECK_VALUE(false, "cplib: no process group is registered under the name '", name,
                      "' (destroyed, or never initialised: pass group.group_name of a live group)");
  }
}

// Groups implemented in Python (the threaded test group, say) only see the
// list-form collectives that their pybind trampoline forwards; C++ backends
// take the single-buffer forms, which avoid a copy on NCCL.
bool python_group(const PG& pg) {
  return dynamic_cast<c10d::PyProcessGroup*>(pg.get()) != nullptr;
}

namespace {

std::vector<at::Tensor> rank_chunks(at::Tensor& flat, int64_t n) {
  return flat.chunk(n, 0);
}

}  // namespace


WorkPtr all_gather_dim0(const PG& pg, at::Tensor& out, at::Tensor& in) {
  if (python_group(pg)) {
    std::vector<std::vector<at::Tensor>> outs{rank_chunks(out, pg->getSize())};
    std::vector<at::Tensor> ins{in};
    return pg->allgather(outs, ins);
  }
  return pg->_allgather_base(out, in);
}

WorkPtr reduce_scatter_sum_dim0(const PG& pg, at::Tensor& out, at::Tensor& in) {
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  if (python_group(pg)) {
    std::vector<at::Tensor> outs{out};
    std::vector<std::vector<at::Tensor>> ins{rank_chunks(in, pg->getSize())};
    return pg->reduce_scatter(outs, ins, opts);
  }
  return pg->_reduce_scatter_base(out, in, opts);
}

WorkPtr all_to_all(const PG& pg, at::Tensor& out, at::Tensor& in) {
  std::vector<int64_t> even;  // empty split sizes: equal chunks along dim 0
  return all_to_all_split(pg, out, in, even, even);
}

WorkPtr all_to_all_split(const PG& pg, at::Tensor& out, at::Tensor& in,
                         std::vector<int64_t>& out_splits, std::vector<int64_t>& in_splits) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13)
  // torch 2.13 renamed the override Python groups implement to all_to_all_single.
  if (python_group(pg)) return pg->all_to_all_single(out, in, out_splits, in_splits);
#endif
  return pg->alltoall_base(out, in, out_splits, in_splits);
}

WorkPtr send(const PG& pg, at::Tensor& t, int dst, int tag) {
  std::vector<at::Tensor> ts{t};
  return pg->send(ts, dst, tag);
}

WorkPtr recv(const PG& pg, at::Tensor& t, int src, int tag) {
  std::vector<at::Tensor> ts{t};
  return pg->recv(ts, src, tag);
}

}  // namespace cplib
