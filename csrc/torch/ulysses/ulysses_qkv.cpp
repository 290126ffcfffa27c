// cplib_c::ulysses_reshard_qkv: q, k and v re-sharded together (three
// all-to-alls in flight at once, each packed while the previous one is on
// the wire). Its backward is the same op in the other direction on
// (dq, dk, dv), registered in cplib/ulysses/op.py.
#include "ulysses/ulysses.h"

namespace cplib::ulysses {
namespace {

std::tuple<Tensor, Tensor, Tensor> reshard_qkv(const Tensor& q, const Tensor& k, const Tensor& v,
                                               const std::string& group_name, bool to_heads,
                                               int64_t kv_head_repeat,
                                               const std::optional<std::vector<int64_t>>& lengths,
                                               bool handshake) {
  std::vector<Tensor> out = reshard_many({q, k, v}, group_name, to_heads,
                                         {1, kv_head_repeat, kv_head_repeat},
                                         lengths.value_or(std::vector<int64_t>{}), handshake);
  return {out[0], out[1], out[2]};
}

std::tuple<Tensor, Tensor, Tensor> reshard_qkv_op(Tensor q, Tensor k, Tensor v,
                                                  std::string group_name, bool to_heads,
                                                  int64_t kv_head_repeat,
                                                  std::optional<std::vector<int64_t>> lengths) {
  return reshard_qkv(q, k, v, group_name, to_heads, kv_head_repeat, lengths, true);
}

// Internal: the same without a handshake (the backward through autograd,
// covered by its forward's).
std::tuple<Tensor, Tensor, Tensor> reshard_qkv_covered_op(
    Tensor q, Tensor k, Tensor v, std::string group_name, bool to_heads, int64_t kv_head_repeat,
    std::optional<std::vector<int64_t>> lengths) {
  return reshard_qkv(q, k, v, group_name, to_heads, kv_head_repeat, lengths, false);
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(cplib_c, m) {
  m.def(
      "ulysses_reshard_qkv(Tensor q, Tensor k, Tensor v, str group_name, bool to_heads, "
      "int kv_head_repeat, int[]? lengths=None) -> (Tensor, Tensor, Tensor)");
  m.def(
      "ulysses_reshard_qkv_covered(Tensor q, Tensor k, Tensor v, str group_name, bool to_heads, "
      "int kv_head_repeat, int[]? lengths=None) -> (Tensor, Tensor, Tensor)");
}

STABLE_TORCH_LIBRARY_IMPL(cplib_c, CPU, m) {
  m.impl("ulysses_reshard_qkv", CPLIB_BOX(&reshard_qkv_op));
  m.impl("ulysses_reshard_qkv_covered", CPLIB_BOX(&reshard_qkv_covered_op));
}

#ifdef CPLIB_WITH_CUDA
STABLE_TORCH_LIBRARY_IMPL(cplib_c, CUDA, m) {
  m.impl("ulysses_reshard_qkv", CPLIB_BOX(&reshard_qkv_op));
  m.impl("ulysses_reshard_qkv_covered", CPLIB_BOX(&reshard_qkv_covered_op));
}
#endif

}  // namespace cplib::ulysses
