// cplib_c::ulysses_reshard_qkv: q, k and v re-sharded together (three
// all-to-alls in flight at once, each packed while the previous one is on
// the wire). Its backward is the same op in the other direction on
// (dq, dk, dv), registered in cplib/_ulysses.py.
#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/library.h>

#include "ulysses/ulysses.h"

namespace cplib::ulysses {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> reshard_qkv_op(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, c10::string_view group_name,
    bool to_heads, int64_t kv_head_repeat, at::OptionalIntArrayRef lengths) {
  at::AutoDispatchBelowADInplaceOrView guard;  // internal buffers and views (see ring_op.cpp)
  std::vector<at::Tensor> out =
      reshard_many({q, k, v}, {group_name.data(), group_name.size()}, to_heads,
                   {1, kv_head_repeat, kv_head_repeat},
                   lengths.has_value() ? lengths->vec() : std::vector<int64_t>{});
  return {out[0], out[1], out[2]};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cplib_c, m) {
  m.def(
      "ulysses_reshard_qkv(Tensor q, Tensor k, Tensor v, str group_name, bool to_heads, "
      "int kv_head_repeat, int[]? lengths=None) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(cplib_c, CPU, m) { m.impl("ulysses_reshard_qkv", &reshard_qkv_op); }

#ifdef CPLIB_WITH_CUDA
TORCH_LIBRARY_IMPL(cplib_c, CUDA, m) { m.impl("ulysses_reshard_qkv", &reshard_qkv_op); }
#endif

}  // namespace cplib::ulysses
