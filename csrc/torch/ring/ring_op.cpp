// cplib_c::ring_sdpa / ring_sdpa_backward: ring attention over a process
// group (codes for `rotate` and `backend` are documented in ring.h), and a
// debug counter of the bytes the rings have sent.
#include <initializer_list>

#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/util/bit_cast.h>
#include <torch/library.h>

#include "comm/consistency.h"
#include "ring/ring_forward.h"
#include "ring/ring_lengths.h"
#include "ring/ring_rotate.h"

namespace cplib::ring {
namespace {

std::string_view sv(c10::string_view s) { return {s.data(), s.size()}; }

// The ring's buffers are internal: no autograd view tracking on them. Without
// this, gloo's worker threads copying into views of a gather buffer trip
// autograd's view-rebase check when the op is called with grad mode on.
using NoViewTracking = at::AutoDispatchBelowADInplaceOrView;

Extras extras(const std::optional<at::Tensor>& cu_seqlens, at::OptionalIntArrayRef window,
              std::optional<int64_t> seq_len, bool per_document) {
  Extras e;
  e.per_document = per_document;
  e.cu_seqlens = cu_seqlens;
  if (window.has_value()) e.window = window->vec();
  e.seq_len = seq_len;
  return e;
}

// Check mode: every rank must make the same call (before any validation
// that could raise on one rank only). With seq_len, or without a causal
// mask, the local lengths may differ by design (uneven shards, joint
// streams), so dim 2 is left out.
void check_same_call(const char* op, std::string_view group_name,
                     std::initializer_list<std::pair<const char*, const at::Tensor*>> tensors,
                     bool is_causal, bool load_balanced, std::optional<double> scale,
                     int64_t backend, int64_t rotate, const Extras& ex) {
  if (!consistency_checks_enabled()) return;
  CallSignature sig;
  for (const auto& [name, t] : tensors) {
    if ((!ex.seq_len && !ex.per_document && is_causal) || !t->defined()) {
      sig.add_meta(name, *t);
      continue;
    }
    const std::string n(name);
    sig.add(n + ".dim()", t->dim());
    for (int64_t d = 0; d < t->dim(); ++d)
      if (d != 2) sig.add(n + ".size(" + std::to_string(d) + ")", t->size(d));
    sig.add(n + ".dtype (ScalarType code)", static_cast<int64_t>(t->scalar_type()));
    sig.add(n + ".device type", static_cast<int64_t>(t->device().type()));
  }
  sig.add("seq_len given", ex.seq_len.has_value());
  sig.add("seq_len", ex.seq_len.value_or(0));
  sig.add("window given", ex.window.has_value());
  for (size_t i = 0; ex.window && i < ex.window->size(); ++i)
    sig.add("window[" + std::to_string(i) + "]", (*ex.window)[i]);
  sig.add("per_document", ex.per_document);
  sig.add("cu_seqlens given", ex.cu_seqlens.has_value());
  if (ex.cu_seqlens) {
    sig.add("cu_seqlens.numel()", ex.cu_seqlens->numel());
    sig.add_values_hash("cu_seqlens", *ex.cu_seqlens);
  }
  sig.add("is_causal", is_causal);
  sig.add("load_balanced", load_balanced);
  sig.add("scale given", scale.has_value());
  sig.add("scale (float64 bits)", scale ? c10::bit_cast<int64_t>(*scale) : 0);
  sig.add("backend", backend);
  sig.add("rotate", rotate);
  check_consistent(resolve_group(group_name), op, sig, tensors.begin()->second->device());
}

std::tuple<at::Tensor, at::Tensor> ring_sdpa(const at::Tensor& q, const at::Tensor& k,
                                             const at::Tensor& v, c10::string_view group_name,
                                             bool is_causal, bool load_balanced,
                                             std::optional<double> scale, int64_t backend,
                                             int64_t rotate,
                                             const std::optional<at::Tensor>& cu_seqlens,
                                             at::OptionalIntArrayRef window,
                                             std::optional<int64_t> seq_len,
                                             bool per_document) {
  NoViewTracking guard;
  const Extras ex = extras(cu_seqlens, window, seq_len, per_document);
  check_same_call("ring_sdpa", sv(group_name), {{"q", &q}, {"k", &k}, {"v", &v}}, is_causal,
                  load_balanced, scale, backend, rotate, ex);
  Config cfg = check_args("ring_sdpa", q, k, v, sv(group_name), is_causal, load_balanced, scale,
                          backend, rotate, ex);
  learn_local_lengths("ring_sdpa", cfg, q, k, ex);
  return ring_forward(cfg, q, k, v);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> ring_sdpa_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, c10::string_view group_name, bool is_causal,
    bool load_balanced, std::optional<double> scale, int64_t backend, int64_t rotate,
    const std::optional<at::Tensor>& cu_seqlens, at::OptionalIntArrayRef window,
    std::optional<int64_t> seq_len, bool per_document) {
  const Extras ex = extras(cu_seqlens, window, seq_len, per_document);
  check_same_call("ring_sdpa_backward", sv(group_name),
                  {{"q", &q}, {"k", &k}, {"v", &v}, {"grad_out", &grad_out}, {"out", &out},
                   {"lse", &lse}},
                  is_causal, load_balanced, scale, backend, rotate, ex);
  const std::vector<int64_t> out_sizes{q.size(0), q.size(1), q.size(2), v.size(3)};
  const std::vector<int64_t> lse_sizes{q.size(0), q.size(1), q.size(2)};
  TORCH_CHECK_VALUE(q.dim() == 4 && v.dim() == 4, "cplib.ring_sdpa_backward: expected 4-D q and v",
                    ", got ", q.sizes(), " and ", v.sizes());
  TORCH_CHECK_VALUE(grad_out.sizes() == out_sizes && out.sizes() == out_sizes, "cplib.",
                    "ring_sdpa_backward: grad_out ", grad_out.sizes(), " and out ", out.sizes(),
                    " must have shape ", out_sizes);
  TORCH_CHECK_VALUE(grad_out.scalar_type() == q.scalar_type() &&
                        out.scalar_type() == q.scalar_type(),
                    "cplib.ring_sdpa_backward: grad_out (", grad_out.scalar_type(), ") and out (",
                    out.scalar_type(), ") must have q's dtype ", q.scalar_type());
  TORCH_CHECK_VALUE(lse.sizes() == lse_sizes && lse.scalar_type() == acc_dtype(q),
                    "cplib.ring_sdpa_backward: lse must be ", acc_dtype(q), " of shape ",
                    lse_sizes, ", got ", lse.scalar_type(), " ", lse.sizes());
  TORCH_CHECK_VALUE(grad_out.device() == q.device() && out.device() == q.device() &&
                        lse.device() == q.device(),
                    "cplib.ring_sdpa_backward: grad_out, out and lse must be on ", q.device());
  NoViewTracking guard;
  Config cfg = check_args("ring_sdpa_backward", q, k, v, sv(group_name), is_causal, load_balanced,
                          scale, backend, rotate, ex);
  learn_local_lengths("ring_sdpa_backward", cfg, q, k, ex);
  return ring_backward(cfg, grad_out, q, k, v, out, lse);
}

int64_t ring_debug_bytes_sent(bool reset) { return bytes_sent(reset); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(cplib_c, m) {
  m.def(
      "ring_sdpa(Tensor q, Tensor k, Tensor v, str group_name, bool is_causal, "
      "bool load_balanced, float? scale, int backend, int rotate, Tensor? cu_seqlens=None, "
      "int[]? window=None, int? seq_len=None, bool per_document=False) "
      "-> (Tensor out, Tensor lse)");
  m.def(
      "ring_sdpa_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "str group_name, bool is_causal, bool load_balanced, float? scale, int backend, "
      "int rotate, Tensor? cu_seqlens=None, int[]? window=None, int? seq_len=None, "
      "bool per_document=False) -> (Tensor dq, Tensor dk, Tensor dv)");
  m.def("ring_debug_bytes_sent(bool reset=False) -> int", &ring_debug_bytes_sent);
}

TORCH_LIBRARY_IMPL(cplib_c, CPU, m) {
  m.impl("ring_sdpa", &ring_sdpa);
  m.impl("ring_sdpa_backward", &ring_sdpa_backward);
}

#ifdef CPLIB_WITH_CUDA
TORCH_LIBRARY_IMPL(cplib_c, CUDA, m) {
  m.impl("ring_sdpa", &ring_sdpa);
  m.impl("ring_sdpa_backward", &ring_sdpa_backward);
}
#endif

}  // namespace cplib::ring
