// cplib_c::flex_cp_allgather and its reduce-scatter backward.
#include <string>
#include <utility>
#include <vector>

#include "comm/collectives.h"
#include "comm/handshake.h"
#include "common/aten.h"
#include "common/checks.h"
#include "common/format.h"
#include "common/stable.h"
#include "flex/calls_begun.h"

namespace cplib::flex {
namespace {

namespace ops = torch::stable;

// k and v may differ in heads (dim 1 of B,H,S,D: GQA) and features (last
// dim); everything else must agree or the gathered pair is meaningless.
void check_pair(const Tensor& k, const Tensor& v, int64_t dim, const char* op) {
  CPLIB_CHECK_VALUE(k.dim() == v.dim(), "cplib.", op, ": k and v must have the same number of ",
                    "dimensions, got k ", k.sizes(), " and v ", v.sizes());
  CPLIB_CHECK_VALUE(k.device() == v.device(), "cplib.", op, ": k is on ", k.device(),
                    " but v is on ", v.device());
  CPLIB_CHECK_VALUE(k.is_cpu() || k.is_cuda(), "cplib.", op, ": unsupported device ", k.device());
  for (const auto& [name, t] : {std::pair{"k", &k}, std::pair{"v", &v}})
    CPLIB_CHECK_VALUE(is_floating(t->scalar_type()), "cplib.", op, ": ", name, " has dtype ",
                      torch::headeronly::toString(t->scalar_type()),
                      "; expected a floating dtype (float32, float64, bfloat16 or float16)");
  for (int64_t d = 0; d < k.dim(); ++d) {
    const bool free_dim = d != dim && k.dim() == 4 && (d == 1 || d == 3);
    CPLIB_CHECK_VALUE(free_dim || k.size(d) == v.size(d), "cplib.", op,
                      ": k and v shapes differ in dimension ", d, " (k ", k.sizes(), ", v ",
                      v.sizes(), "); only the head and feature dimensions may differ");
  }
}

// The group and the normalised seq_dim, after the handshake: every rank
// fails alike or none does. `more_checks` are the backward's own.
template <class F>
std::pair<Group, int64_t> checked_call(const char* op, const Tensor& k, const Tensor& v,
                                       int64_t seq_dim, const std::string& group_name,
                                       F&& more_checks, bool handshake = true) {
  Group group = resolve_group(group_name);
  int64_t dim = 0;
  if (!handshake) {  // covered by another op's handshake: the checks raise here
    dim = checked_dim(seq_dim, k.dim(), "seq_dim");
    check_pair(k, v, dim, op);
    more_checks(k, dim, group.size);
    return {std::move(group), dim};
  }
  note_call_begun();
  Handshake hs(op);
  hs.validate([&] {
    dim = checked_dim(seq_dim, k.dim(), "seq_dim");
    check_pair(k, v, dim, op);
    more_checks(k, dim, group.size);
    hs.sig().add_meta("k", k);
    hs.sig().add_meta("v", v);
    hs.sig().add("seq_dim", dim);
  });
  hs.exchange(group);
  return {std::move(group), dim};
}

// [N * d0, ...] gathered rank-major -> a fresh contiguous [..., N*S, ...].
Tensor chunks_to_dim(const Tensor& gathered, const Tensor& like, int64_t dim, int64_t n) {
  std::vector<int64_t> chunk_shape = like.sizes().vec();
  chunk_shape.insert(chunk_shape.begin(), n);
  const Tensor chunks = ops::view(gathered, chunk_shape);  // [N, ..., S, ...]
  if (dim == 0) return ops::flatten(chunks, 0, 1);
  const Tensor moved = aten::movedim(chunks, 0, dim);  // [..., N, S, ...]
  std::vector<int64_t> full_shape = like.sizes().vec();
  full_shape[dim] *= n;
  Tensor full = ops::new_empty(gathered, full_shape);
  Tensor target = ops::view(full, moved.sizes());
  ops::copy_(target, moved);
  return full;
}

// [..., N*S, ...] -> contiguous [N * d0, ...] (rank-major, chunk i being rank
// i's slice), as the reduce-scatter reads it.
Tensor dim_to_chunks(const Tensor& full, int64_t dim, int64_t n) {
  std::vector<int64_t> s = full.sizes().vec();
  s[dim] /= n;
  s.insert(s.begin() + dim, n);
  return ops::flatten(ops::contiguous(aten::movedim(ops::reshape(full, s), dim, 0)), 0, 1);
}

std::tuple<Tensor, Tensor> flex_cp_allgather(Tensor k, Tensor v, int64_t seq_dim,
                                             std::string group_name) {
  const auto [group, dim] = checked_call("flex_cp_allgather", k, v, seq_dim, group_name,
                                         [](auto&&...) {});
  const Tensor kin = ops::contiguous(k), vin = ops::contiguous(v);
  // Both gathers in flight before either is waited on.
  const Tensor kbuf = all_gather_dim0(group, kin);
  const Tensor vbuf = all_gather_dim0(group, vin);
  wait(kbuf);
  wait(vbuf);
  return {chunks_to_dim(kbuf, kin, dim, group.size), chunks_to_dim(vbuf, vin, dim, group.size)};
}

std::tuple<Tensor, Tensor> reduce_scatter(const Tensor& grad_k, const Tensor& grad_v,
                                          int64_t seq_dim, const std::string& group_name,
                                          bool handshake) {
  const auto [group, dim] = checked_call(
      "flex_cp_allgather_backward", grad_k, grad_v, seq_dim, group_name,
      [](const Tensor& gk, int64_t d, int64_t n) {
        CPLIB_CHECK_VALUE(gk.size(d) % n == 0, "cplib.flex_cp_allgather_backward: sequence ",
                          "length ", gk.size(d), " is not divisible by the group size ", n);
      },
      handshake);
  const Tensor kin = dim_to_chunks(grad_k, dim, group.size);
  const Tensor vin = dim_to_chunks(grad_v, dim, group.size);
  const Tensor kout = reduce_scatter_sum_dim0(group, kin);
  const Tensor vout = reduce_scatter_sum_dim0(group, vin);
  wait(kout);
  wait(vout);
  return {kout, vout};
}

std::tuple<Tensor, Tensor> flex_cp_allgather_backward(Tensor grad_k, Tensor grad_v, int64_t seq_dim,
                                                      std::string group_name) {
  return reduce_scatter(grad_k, grad_v, seq_dim, group_name, true);
}

// Internal: the backward through autograd, covered by its forward's handshake.
std::tuple<Tensor, Tensor> flex_cp_allgather_backward_covered(Tensor grad_k, Tensor grad_v,
                                                              int64_t seq_dim,
                                                              std::string group_name) {
  return reduce_scatter(grad_k, grad_v, seq_dim, group_name, false);
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(cplib_c, m) {
  m.def("flex_cp_allgather(Tensor k, Tensor v, int seq_dim, str group_name) -> (Tensor, Tensor)");
  m.def(
      "flex_cp_allgather_backward(Tensor grad_k, Tensor grad_v, int seq_dim, str group_name) "
      "-> (Tensor, Tensor)");
  m.def(
      "flex_cp_allgather_backward_covered(Tensor grad_k, Tensor grad_v, int seq_dim, "
      "str group_name) -> (Tensor, Tensor)");
}

STABLE_TORCH_LIBRARY_IMPL(cplib_c, CPU, m) {
  m.impl("flex_cp_allgather", CPLIB_BOX(&flex_cp_allgather));
  m.impl("flex_cp_allgather_backward", CPLIB_BOX(&flex_cp_allgather_backward));
  m.impl("flex_cp_allgather_backward_covered", CPLIB_BOX(&flex_cp_allgather_backward_covered));
}

#ifdef CPLIB_WITH_CUDA
STABLE_TORCH_LIBRARY_IMPL(cplib_c, CUDA, m) {
  m.impl("flex_cp_allgather", CPLIB_BOX(&flex_cp_allgather));
  m.impl("flex_cp_allgather_backward", CPLIB_BOX(&flex_cp_allgather_backward));
  m.impl("flex_cp_allgather_backward_covered", CPLIB_BOX(&flex_cp_allgather_backward_covered));
}
#endif

}  // namespace cplib::flex
