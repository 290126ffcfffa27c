// cplib_c::flex_cp_allgather and its reduce-scatter backward.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "common/checks.h"
#include "comm/comm.h"
#include "comm/handshake.h"

namespace cplib {
namespace {

// k and v may differ in heads (dim 1 of B,H,S,D: GQA) and features (last
// dim); everything else must agree or the gathered pair is meaningless.
void check_pair(const at::Tensor& k, const at::Tensor& v, int64_t dim, const char* op) {
  TORCH_CHECK_VALUE(k.dim() == v.dim(), "cplib.", op, ": k and v must have the same number of ",
                    "dimensions, got k ", k.sizes(), " and v ", v.sizes());
  TORCH_CHECK_VALUE(k.device() == v.device(), "cplib.", op, ": k is on ", k.device(),
                    " but v is on ", v.device());
  TORCH_CHECK_VALUE(k.device().is_cpu() || k.device().is_cuda(), "cplib.", op,
                    ": unsupported device ", k.device());
  for (const auto& [name, t] : {std::pair{"k", &k}, std::pair{"v", &v}})
    TORCH_CHECK_VALUE(at::isFloatingType(t->scalar_type()), "cplib.", op, ": ", name,
                      " has dtype ", t->scalar_type(), "; expected a floating dtype (float32, "
                      "float64, bfloat16 or float16)");
  for (int64_t d = 0; d < k.dim(); ++d) {
    const bool free_dim = d != dim && k.dim() == 4 && (d == 1 || d == 3);
    TORCH_CHECK_VALUE(free_dim || k.size(d) == v.size(d), "cplib.", op,
                      ": k and v shapes differ in dimension ", d, " (k ", k.sizes(), ", v ",
                      v.sizes(), "); only the head and feature dimensions may differ");
  }
}

// The group and the normalised seq_dim, after the handshake: every rank
// fails alike or none does. `more_checks` are the backward's own.
template <class F>
std::pair<PG, int64_t> checked_call(const char* op, const at::Tensor& k, const at::Tensor& v,
                                    int64_t seq_dim, c10::string_view group_name,
                                    F&& more_checks) {
  const std::string_view name(group_name.data(), group_name.size());
  PG pg = resolve_group(name);
  Handshake hs(op);
  int64_t dim = 0;
  hs.validate([&] {
    dim = checked_dim(seq_dim, k.dim(), "seq_dim");
    check_pair(k, v, dim, op);
    more_checks(k, dim, pg->getSize());
    hs.sig().add_meta("k", k);
    hs.sig().add_meta("v", v);
    hs.sig().add("seq_dim", dim);
  });
  hs.exchange(name, pg, k.device());
  return {std::move(pg), dim};
}

// [N, ..., S, ...] gathered chunks -> a fresh contiguous [..., N*S, ...].
at::Tensor chunks_to_dim(const at::Tensor& chunks, int64_t dim) {
  if (dim == 0) return chunks.flatten(0, 1);
  auto moved = chunks.movedim(0, dim);  // [..., N, S, ...]
  auto full_shape = chunks.sizes().slice(1).vec();
  full_shape[dim] *= chunks.size(0);
  at::Tensor full = at::empty(full_shape, chunks.options());
  full.view(moved.sizes()).copy_(moved);
  return full;
}

// [..., N*S, ...] -> contiguous [N, ..., S, ...], chunk i being rank i's slice.
at::Tensor dim_to_chunks(const at::Tensor& full, int64_t dim, int64_t n) {
  auto s = full.sizes().vec();
  s[dim] /= n;
  s.insert(s.begin() + dim, n);
  return full.reshape(s).movedim(dim, 0).contiguous();
}

std::tuple<at::Tensor, at::Tensor> flex_cp_allgather(const at::Tensor& k, const at::Tensor& v,
                                                     int64_t seq_dim,
                                                     c10::string_view group_name) {
  const auto [pg, dim] =
      checked_call("flex_cp_allgather", k, v, seq_dim, group_name, [](auto&&...) {});
  const int64_t n = pg->getSize();

  at::Tensor kin = k.contiguous(), vin = v.contiguous();
  // The collective fills [N * d0, ...]; viewed as [N, d0, ...] it is rank-major.
  auto gather_buffer = [n](const at::Tensor& t) {
    auto s = t.sizes().vec();
    s[0] *= n;
    return at::empty(s, t.options());
  };
  at::Tensor kbuf = gather_buffer(kin), vbuf = gather_buffer(vin);
  WorkPtr wk = all_gather_dim0(pg, kbuf, kin);
  WorkPtr wv = all_gather_dim0(pg, vbuf, vin);
  wait(wk);
  wait(wv);
  auto as_chunks = [n](const at::Tensor& buf, const at::Tensor& t) {
    auto s = t.sizes().vec();
    s.insert(s.begin(), n);
    return buf.view(s);
  };
  kbuf = as_chunks(kbuf, kin);
  vbuf = as_chunks(vbuf, vin);
  return {chunks_to_dim(kbuf, dim), chunks_to_dim(vbuf, dim)};
}

std::tuple<at::Tensor, at::Tensor> flex_cp_allgather_backward(const at::Tensor& grad_k,
                                                              const at::Tensor& grad_v,
                                                              int64_t seq_dim,
                                                              c10::string_view group_name) {
  const auto [pg, dim] = checked_call(
      "flex_cp_allgather_backward", grad_k, grad_v, seq_dim, group_name,
      [](const at::Tensor& gk, int64_t d, int64_t n) {
        TORCH_CHECK_VALUE(gk.size(d) % n == 0, "cplib.flex_cp_allgather_backward: sequence ",
                          "length ", gk.size(d), " is not divisible by the group size ", n);
      });
  const int64_t n = pg->getSize();

  at::Tensor kin = dim_to_chunks(grad_k, dim, n), vin = dim_to_chunks(grad_v, dim, n);
  at::Tensor kout = at::empty(kin.sizes().slice(1), kin.options());
  at::Tensor vout = at::empty(vin.sizes().slice(1), vin.options());
  kin = kin.flatten(0, 1);  // the collective reads [N * d0, ...]
  vin = vin.flatten(0, 1);
  WorkPtr wk = reduce_scatter_sum_dim0(pg, kout, kin);
  WorkPtr wv = reduce_scatter_sum_dim0(pg, vout, vin);
  wait(wk);
  wait(wv);
  return {kout, vout};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cplib_c, m) {
  m.def("flex_cp_allgather(Tensor k, Tensor v, int seq_dim, str group_name) -> (Tensor, Tensor)");
  m.def(
      "flex_cp_allgather_backward(Tensor grad_k, Tensor grad_v, int seq_dim, str group_name) "
      "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(cplib_c, CPU, m) {
  m.impl("flex_cp_allgather", &flex_cp_allgather);
  m.impl("flex_cp_allgather_backward", &flex_cp_allgather_backward);
}

#ifdef CPLIB_WITH_CUDA
TORCH_LIBRARY_IMPL(cplib_c, CUDA, m) {
  m.impl("flex_cp_allgather", &flex_cp_allgather);
  m.impl("flex_cp_allgather_backward", &flex_cp_allgather_backward);
}
#endif

}  // namespace cplib
