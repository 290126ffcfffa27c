// cplib_c::ring_sdpa / ring_sdpa_backward: ring attention over a process
// group (codes for `rotate` and `backend` are documented in ring.h), and a
// debug counter of the bytes the rings have sent.
#include <initializer_list>

#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/library.h>

#include "comm/handshake.h"
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
              std::optional<int64_t> seq_len, bool per_document,
              const std::optional<at::Tensor>& q_positions = std::nullopt,
              const std::optional<at::Tensor>& kv_positions = std::nullopt,
              int64_t ring_pass = kPassKV) {
  Extras e;
  e.q_positions = q_positions;
  e.kv_positions = kv_positions;
  e.ring_pass = ring_pass;
  e.per_document = per_document;
  e.cu_seqlens = cu_seqlens;
  if (window.has_value()) e.window = window->vec();
  e.seq_len = seq_len;
  return e;
}

// What every rank of the ring must agree on, one line per argument. With
// seq_len, per_document, explicit positions or no causal mask the local
// lengths may differ by design (uneven shards, joint text+image streams), so
// dim 2 is left out: the local checks and learn_local_lengths cover it.
void describe(CallSignature& sig,
              std::initializer_list<std::pair<const char*, const at::Tensor*>> tensors,
              bool is_causal, bool load_balanced, std::optional<double> scale, int64_t backend,
              int64_t rotate, const Extras& ex) {
  sig.add("seq_len", ex.seq_len.value_or(-1));
  sig.add_flag("window is not None", ex.window.has_value());
  for (size_t i = 0; ex.window && i < ex.window->size(); ++i)
    sig.add("window[" + std::to_string(i) + "]", (*ex.window)[i]);
  sig.add_flag("per_document", ex.per_document);
  sig.add_flag("cu_seqlens is not None", ex.cu_seqlens.has_value());
  if (ex.cu_seqlens) sig.add_values_hash("cu_seqlens", *ex.cu_seqlens);
  sig.add_flag("q_positions is not None", ex.q_positions.has_value());
  sig.add_flag("kv_positions is not None", ex.kv_positions.has_value());
  sig.add("ring_pass", ex.ring_pass);
  sig.add_flag("is_causal", is_causal);
  sig.add_flag("load_balanced", load_balanced);
  sig.add_optional_float("scale", scale);
  sig.add("backend", backend);
  sig.add("rotate", rotate);
  // The tensors last: a flag that differs is named before the shapes it implies.
  const bool uneven = ex.seq_len || ex.per_document || ex.has_positions() || !is_causal;
  for (const auto& [name, t] : tensors) sig.add_meta(name, *t, uneven ? 2 : -1);
}

// Local validation, then the handshake: every rank raises alike or none does.
// `more_checks` are the backward's own checks.
template <class F>
Config agreed_config(const char* op, std::string_view group_name,
                     std::initializer_list<std::pair<const char*, const at::Tensor*>> tensors,
                     bool is_causal, bool load_balanced, std::optional<double> scale,
                     int64_t backend, int64_t rotate, const Extras& ex, F&& more_checks) {
  PG pg = resolve_group(group_name);
  const at::Tensor& q = *tensors.begin()->second;
  const at::Tensor& k = *(tensors.begin() + 1)->second;
  const at::Tensor& v = *(tensors.begin() + 2)->second;
  Handshake hs(op);
  Config cfg;
  hs.validate([&] {
    more_checks();
    cfg = check_args(op, q, k, v, group_name, is_causal, load_balanced, scale, backend, rotate,
                     ex);
    describe(hs.sig(), tensors, is_causal, load_balanced, scale, backend, rotate, ex);
    hs.set_lengths({q.size(2), k.size(2)});
  });
  hs.exchange(group_name, pg, q.device());
  if (!ex.has_positions()) learn_local_lengths(op, cfg, q, k, ex, hs);
  return cfg;
}

std::tuple<at::Tensor, at::Tensor> ring_sdpa(const at::Tensor& q, const at::Tensor& k,
                                             const at::Tensor& v, c10::string_view group_name,
                                             bool is_causal, bool load_balanced,
                                             std::optional<double> scale, int64_t backend,
                                             int64_t rotate,
                                             const std::optional<at::Tensor>& cu_seqlens,
                                             at::OptionalIntArrayRef window,
                                             std::optional<int64_t> seq_len,
                                             bool per_document,
                                             const std::optional<at::Tensor>& sinks,
                                             const std::optional<at::Tensor>& q_positions,
                                             const std::optional<at::Tensor>& kv_positions,
                                             int64_t ring_pass) {
  NoViewTracking guard;
  const Extras ex =
      extras(cu_seqlens, window, seq_len, per_document, q_positions, kv_positions, ring_pass);
  Config cfg = agreed_config("ring_sdpa", sv(group_name), {{"q", &q}, {"k", &k}, {"v", &v}},
                             is_causal, load_balanced, scale, backend, rotate, ex, [&] {
                               if (sinks) check_sinks("ring_sdpa", q, *sinks);
                             });
  finish_config(cfg, ex, q, k, v);
  return ring_forward(cfg, q, k, v, sinks ? *sinks : at::Tensor());
}

// The backward's checks of its extra tensors (the forward's outputs).
void check_backward_tensors(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& v,
                            const at::Tensor& out, const at::Tensor& lse) {
  TORCH_CHECK_VALUE(q.dim() == 4 && v.dim() == 4, "cplib.ring_sdpa_backward: expected 4-D q and v",
                    ", got ", q.sizes(), " and ", v.sizes());
  const std::vector<int64_t> out_sizes{q.size(0), q.size(1), q.size(2), v.size(3)};
  const std::vector<int64_t> lse_sizes{q.size(0), q.size(1), q.size(2)};
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
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> ring_sdpa_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, c10::string_view group_name, bool is_causal,
    bool load_balanced, std::optional<double> scale, int64_t backend, int64_t rotate,
    const std::optional<at::Tensor>& cu_seqlens, at::OptionalIntArrayRef window,
    std::optional<int64_t> seq_len, bool per_document,
    const std::optional<at::Tensor>& q_positions, const std::optional<at::Tensor>& kv_positions,
    int64_t ring_pass) {
  // The backward always runs the pass-KV ring (pass-Q is forward only).
  (void)ring_pass;
  const Extras ex = extras(cu_seqlens, window, seq_len, per_document, q_positions, kv_positions);
  NoViewTracking guard;
  Config cfg = agreed_config(
      "ring_sdpa_backward", sv(group_name),
      {{"q", &q}, {"k", &k}, {"v", &v}, {"grad_out", &grad_out}, {"out", &out}, {"lse", &lse}},
      is_causal, load_balanced, scale, backend, rotate, ex,
      [&] { check_backward_tensors(grad_out, q, v, out, lse); });
  finish_config(cfg, ex, q, k, v);
  return ring_backward(cfg, grad_out, q, k, v, out, lse);
}

int64_t ring_debug_bytes_sent(bool reset) { return bytes_sent(reset); }
int64_t ring_debug_last_pass() { return last_ring_pass(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(cplib_c, m) {
  m.def(
      "ring_sdpa(Tensor q, Tensor k, Tensor v, str group_name, bool is_causal, "
      "bool load_balanced, float? scale, int backend, int rotate, Tensor? cu_seqlens=None, "
      "int[]? window=None, int? seq_len=None, bool per_document=False, "
      "Tensor? sinks=None, Tensor? q_positions=None, Tensor? kv_positions=None, "
      "int ring_pass=0) -> (Tensor out, Tensor lse)");
  m.def(
      "ring_sdpa_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "str group_name, bool is_causal, bool load_balanced, float? scale, int backend, "
      "int rotate, Tensor? cu_seqlens=None, int[]? window=None, int? seq_len=None, "
      "bool per_document=False, Tensor? q_positions=None, Tensor? kv_positions=None, "
      "int ring_pass=0) -> (Tensor dq, Tensor dk, Tensor dv)");
  m.def("ring_debug_bytes_sent(bool reset=False) -> int", &ring_debug_bytes_sent);
  // The ring pass (0 = kv, 1 = q) the last ring_sdpa ran, "auto" resolved.
  m.def("ring_debug_last_pass() -> int", &ring_debug_last_pass);
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
