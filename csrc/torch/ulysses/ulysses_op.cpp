// Schemas and CPU/CUDA registrations of the Ulysses ops:
//   ulysses_reshard: sequence shard <-> head shard (one all-to-all; the
//     backward of one direction is the other, registered in cplib/ulysses/op.py);
//   ulysses_local_sdpa(+_backward): full-sequence attention on the local heads;
//   ulysses_debug_bytes_sent: what the exchanges have sent.
#include "attention/backend.h"
#include "common/box.h"
#include "ulysses/ulysses.h"

namespace cplib::ulysses {
namespace {

Tensor reshard_op(Tensor x, std::string group_name, bool to_heads, int64_t head_repeat,
                  std::optional<std::vector<int64_t>> lengths) {
  return reshard(x, group_name, to_heads, head_repeat, lengths.value_or(std::vector<int64_t>{}));
}

// Internal: the same without a handshake (covered by another op's).
Tensor reshard_covered_op(Tensor x, std::string group_name, bool to_heads, int64_t head_repeat,
                          std::optional<std::vector<int64_t>> lengths) {
  return reshard(x, group_name, to_heads, head_repeat, lengths.value_or(std::vector<int64_t>{}),
                 false);
}

// The backend by name (attention/backend.h).
std::tuple<Tensor, Tensor> local_sdpa_op(Tensor q, Tensor k, Tensor v, bool is_causal,
                                         std::optional<double> scale, std::string backend,
                                         std::optional<Tensor> sinks) {
  return local_sdpa(q, k, v, is_causal, scale,
                    attention::backend_code("ulysses_local_sdpa", backend),
                    sinks ? *sinks : Tensor());
}

std::tuple<Tensor, Tensor, Tensor> local_sdpa_backward_op(Tensor grad_out, Tensor q, Tensor k,
                                                          Tensor v, Tensor out, Tensor lse,
                                                          bool is_causal,
                                                          std::optional<double> scale,
                                                          std::string backend) {
  return local_sdpa_backward(grad_out, q, k, v, out, lse, is_causal, scale,
                             attention::backend_code("ulysses_local_sdpa_backward", backend));
}

int64_t debug_bytes_sent(bool reset) { return bytes_sent(reset); }

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(cplib_c, m) {
  m.def(
      "ulysses_reshard(Tensor x, str group_name, bool to_heads, int head_repeat, "
      "int[]? lengths=None) -> Tensor");
  m.def(
      "ulysses_reshard_covered(Tensor x, str group_name, bool to_heads, int head_repeat, "
      "int[]? lengths=None) -> Tensor");
  m.def(
      "ulysses_local_sdpa(Tensor q, Tensor k, Tensor v, bool is_causal, float? scale, "
      "str backend, Tensor? sinks=None) -> (Tensor out, Tensor lse)");
  m.def(
      "ulysses_local_sdpa_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, "
      "Tensor lse, bool is_causal, float? scale, str backend) -> (Tensor dq, Tensor dk, "
      "Tensor dv)");
  m.def("ulysses_debug_bytes_sent(bool reset=False) -> int");
}

STABLE_TORCH_LIBRARY_IMPL(cplib_c, CPU, m) {
  m.impl("ulysses_reshard", CPLIB_BOX(&reshard_op));
  m.impl("ulysses_reshard_covered", CPLIB_BOX(&reshard_covered_op));
  m.impl("ulysses_local_sdpa", CPLIB_BOX(&local_sdpa_op));
  m.impl("ulysses_local_sdpa_backward", CPLIB_BOX(&local_sdpa_backward_op));
}

#ifdef CPLIB_WITH_CUDA
STABLE_TORCH_LIBRARY_IMPL(cplib_c, CUDA, m) {
  m.impl("ulysses_reshard", CPLIB_BOX(&reshard_op));
  m.impl("ulysses_reshard_covered", CPLIB_BOX(&reshard_covered_op));
  m.impl("ulysses_local_sdpa", CPLIB_BOX(&local_sdpa_op));
  m.impl("ulysses_local_sdpa_backward", CPLIB_BOX(&local_sdpa_backward_op));
}
#endif

// No tensor arguments: dispatches to CompositeExplicitAutograd.
STABLE_TORCH_LIBRARY_IMPL(cplib_c, CompositeExplicitAutograd, m) {
  m.impl("ulysses_debug_bytes_sent", CPLIB_BOX(&debug_bytes_sent));
}

}  // namespace cplib::ulysses
