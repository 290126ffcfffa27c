// Schemas and CPU/CUDA registrations of the Ulysses ops:
//   ulysses_reshard: sequence shard <-> head shard (one all-to-all; the
//     backward of one direction is the other, registered in cplib/_ulysses.py);
//   ulysses_local_sdpa(+_backward): full-sequence attention on the local heads;
//   ulysses_debug_bytes_sent: what the exchanges have sent.
#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/library.h>

#include "ulysses/ulysses.h"

namespace cplib::ulysses {
namespace {

// Internal buffers and views: no autograd view tracking (see ring_op.cpp).
using NoViewTracking = at::AutoDispatchBelowADInplaceOrView;

at::Tensor reshard_op(const at::Tensor& x, c10::string_view group_name, bool to_heads,
                      int64_t head_repeat, at::OptionalIntArrayRef lengths) {
  NoViewTracking guard;
  return reshard(x, {group_name.data(), group_name.size()}, to_heads, head_repeat,
                 lengths.has_value() ? lengths->vec() : std::vector<int64_t>{});
}

std::tuple<at::Tensor, at::Tensor> local_sdpa_op(const at::Tensor& q, const at::Tensor& k,
                                                 const at::Tensor& v, bool is_causal,
                                                 std::optional<double> scale, int64_t backend,
                                                 const std::optional<at::Tensor>& sinks) {
  NoViewTracking guard;
  return local_sdpa(q, k, v, is_causal, scale, backend, sinks ? *sinks : at::Tensor());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> local_sdpa_backward_op(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, bool is_causal, std::optional<double> scale,
    int64_t backend) {
  NoViewTracking guard;
  return local_sdpa_backward(grad_out, q, k, v, out, lse, is_causal, scale, backend);
}

int64_t debug_bytes_sent(bool reset) { return bytes_sent(reset); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(cplib_c, m) {
  m.def(
      "ulysses_reshard(Tensor x, str group_name, bool to_heads, int head_repeat, "
      "int[]? lengths=None) -> Tensor");
  m.def(
      "ulysses_local_sdpa(Tensor q, Tensor k, Tensor v, bool is_causal, float? scale, "
      "int backend, Tensor? sinks=None) -> (Tensor out, Tensor lse)");
  m.def(
      "ulysses_local_sdpa_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, "
      "Tensor lse, bool is_causal, float? scale, int backend) -> (Tensor dq, Tensor dk, "
      "Tensor dv)");
  m.def("ulysses_debug_bytes_sent(bool reset=False) -> int", &debug_bytes_sent);
}

TORCH_LIBRARY_IMPL(cplib_c, CPU, m) {
  m.impl("ulysses_reshard", &reshard_op);
  m.impl("ulysses_local_sdpa", &local_sdpa_op);
  m.impl("ulysses_local_sdpa_backward", &local_sdpa_backward_op);
}

#ifdef CPLIB_WITH_CUDA
TORCH_LIBRARY_IMPL(cplib_c, CUDA, m) {
  m.impl("ulysses_reshard", &reshard_op);
  m.impl("ulysses_local_sdpa", &local_sdpa_op);
  m.impl("ulysses_local_sdpa_backward", &local_sdpa_backward_op);
}
#endif

}  // namespace cplib::ulysses
