// cplib_c::ring_sdpa / ring_sdpa_backward: ring attention over a process
// group (codes for `rotate` and `backend` are documented in ring.h), and a
// debug counter of the bytes the rings have sent.
#include <initializer_list>

#include "comm/handshake.h"
#include "common/format.h"
#include "ring/ring_agreed.h"
#include "ring/ring_forward.h"
#include "ring/ring_lengths.h"
#include "ring/ring_placement.h"
#include "ring/ring_rotate.h"

namespace cplib::ring {
namespace {

Extras extras(const std::optional<Tensor>& cu_seqlens,
              const std::optional<std::vector<int64_t>>& window, std::optional<int64_t> seq_len,
              bool per_document, const std::optional<Tensor>& q_positions = std::nullopt,
              const std::optional<Tensor>& kv_positions = std::nullopt,
              int64_t ring_pass = kPassKV, bool placement = false) {
  Extras e;
  e.placement = placement;
  e.q_positions = q_positions;
  e.kv_positions = kv_positions;
  e.ring_pass = ring_pass;
  e.per_document = per_document;
  e.cu_seqlens = cu_seqlens;
  e.window = window;
  e.seq_len = seq_len;
  return e;
}

// What every rank of the ring must agree on, one line per argument. With
// seq_len, per_document, explicit positions or no causal mask the local
// lengths may differ by design (uneven shards, joint text+image streams), so
// dim 2 is left out: the local checks and learn_local_lengths cover it.
// `bounds`: cu_seqlens as the checks already read them to the host (no
// second read of a device tensor); null where they were not read (meta).
void describe(CallSignature& sig,
              std::initializer_list<std::pair<const char*, const Tensor*>> tensors,
              bool is_causal, bool load_balanced, std::optional<double> scale, int64_t backend,
              int64_t rotate, const Extras& ex, const std::vector<int64_t>* bounds,
              const Placement* placed = nullptr) {
  // The device first: a rank on other tensors (meta beside CPU, say) differs
  // in everything after it, and this names the cause.
  const Tensor& q = *tensors.begin()->second;
  sig.add("q.device type", static_cast<int64_t>(q.device().type()), FieldKind::device);
  sig.add("seq_len", ex.seq_len.value_or(-1));
  sig.add_flag("window is not None", ex.window.has_value());
  for (size_t i = 0; ex.window && i < ex.window->size(); ++i)
    sig.add("window[" + std::to_string(i) + "]", (*ex.window)[i]);
  sig.add_flag("per_document", ex.per_document);
  sig.add_flag("placement", ex.placement);
  sig.add_flag("cu_seqlens is not None", ex.cu_seqlens.has_value());
  if (ex.cu_seqlens) {
    if (bounds)
      sig.add_values_hash("cu_seqlens", *bounds);
    else
      sig.add_values_hash("cu_seqlens", *ex.cu_seqlens);
  }
  // The placement each rank computed (the same function of cu_seqlens and N
  // everywhere, unless the ranks run different builds).
  if (placed) sig.add_values_hash("document placement", flatten(*placed));
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

// What the last ring_sdpa of this thread agreed (ring_agreed.h). Read by the
// autograd formula right after the forward (cplib/ring/op.py) and handed to
// the backward, which then reads none of its inputs again and makes no
// handshake, no all-gather of its own.
thread_local Agreed t_agreed;

// Local validation, then the handshake: every rank raises alike or none does.
// `more_checks` are the backward's own checks. With `covered` (what the
// forward whose handshake covers this call agreed: the backward through
// autograd) there is no handshake, and the checks run on the forward's
// values (its documents and positions, as it read them), which passed its
// handshake on every rank: nothing is re-read that could fail on one rank
// alone. `learned`: every rank's {q rows, k/v rows}, when exchanged.
template <class F>
Config agreed_config(const char* op, std::string_view group_name,
                     std::initializer_list<std::pair<const char*, const Tensor*>> tensors,
                     bool is_causal, bool load_balanced, std::optional<double> scale,
                     int64_t backend, int64_t rotate, const Extras& ex, F&& more_checks,
                     const Agreed* covered, std::vector<int64_t>& learned) {
  const Group group = resolve_group(group_name);
  const Tensor& q = *tensors.begin()->second;
  const Tensor& k = *(tensors.begin() + 1)->second;
  const Tensor& v = *(tensors.begin() + 2)->second;
  Config cfg;
  auto checks = [&] {
    more_checks();
    cfg = check_args(op, q, k, v, group, is_causal, load_balanced, scale, backend, rotate, ex);
  };
  std::vector<int64_t> table;  // rank-major {q rows, k/v rows}, when exchanged
  if (covered) {
    if (covered->has_bounds) ex.host.cu_seqlens = covered->bounds;
    if (static_cast<int64_t>(covered->q_positions.size()) > group.rank) {
      ex.host.q_positions = covered->q_positions[group.rank];
      ex.host.kv_positions = covered->kv_positions[group.rank];
    }
    checks();
    table = covered->lengths;
  } else {
    Handshake hs(op);
    hs.validate([&] {
      checks();
      describe(hs.sig(), tensors, is_causal, load_balanced, scale, backend, rotate, ex,
               &cfg.mask.bounds, cfg.q_layout.placed.get());
      hs.set_lengths({q.size(2), k.size(2)});
    });
    hs.exchange(group);
    for (int64_t r = 0; hs.exchanged() && r < group.size; ++r) {
      const std::vector<int64_t> l = hs.lengths(r);
      table.insert(table.end(), l.begin(), l.end());
    }
  }
  // Explicit positions keep the table for gathering them (finish_config).
  if (!ex.has_positions()) learn_local_lengths(op, cfg, q, k, ex, table);
  learned = std::move(table);
  return cfg;
}

// The handshake of a call on meta tensors, which compute nothing (the fake
// kernel does): a rank on meta tensors beside ranks on real ones meets them
// in the handshake, so every rank raises the same error naming the device,
// instead of the real ranks waiting for a rank that never communicates.
// The Python checks of the fake kernel ran before (their errors join the
// handshake through cplib_c::handshake_error).
void describe_call(std::string op, std::vector<Tensor> tensors, std::string group_name,
                   bool is_causal, bool load_balanced, std::optional<double> scale,
                   int64_t backend, int64_t rotate, std::optional<Tensor> cu_seqlens,
                   std::optional<std::vector<int64_t>> window, std::optional<int64_t> seq_len,
                   bool per_document, std::optional<Tensor> q_positions,
                   std::optional<Tensor> kv_positions, int64_t ring_pass, bool placement) {
  CPLIB_CHECK_VALUE(op == "ring_sdpa" || op == "ring_sdpa_backward",
                    "cplib.ring_describe_call: unknown op '", op, "'");
  CPLIB_CHECK_VALUE(tensors.size() == (op == "ring_sdpa" ? 3u : 6u), "cplib.", op, ": ",
                    tensors.size(), " tensors to describe");
  const Group group = resolve_group(group_name);
  const Extras ex = extras(cu_seqlens, window, seq_len, per_document, q_positions, kv_positions,
                           op == "ring_sdpa" ? ring_pass : kPassKV, placement);
  Handshake hs(op);
  hs.validate([&] {
    if (tensors.size() == 3)
      describe(hs.sig(), {{"q", &tensors[0]}, {"k", &tensors[1]}, {"v", &tensors[2]}}, is_causal,
               load_balanced, scale, backend, rotate, ex, nullptr);
    else
      describe(hs.sig(), {{"q", &tensors[1]}, {"k", &tensors[2]}, {"v", &tensors[3]},
                          {"grad_out", &tensors[0]}, {"out", &tensors[4]}, {"lse", &tensors[5]}},
               is_causal, load_balanced, scale, backend, rotate, ex, nullptr);
    const Tensor& q = tensors[tensors.size() == 3 ? 0 : 1];
    const Tensor& k = tensors[tensors.size() == 3 ? 1 : 2];
    hs.set_lengths({q.size(2), k.size(2)});
  });
  hs.exchange(group);
}

std::tuple<Tensor, Tensor> ring_sdpa(Tensor q, Tensor k, Tensor v, std::string group_name,
                                     bool is_causal, bool load_balanced,
                                     std::optional<double> scale, int64_t backend, int64_t rotate,
                                     std::optional<Tensor> cu_seqlens,
                                     std::optional<std::vector<int64_t>> window,
                                     std::optional<int64_t> seq_len, bool per_document,
                                     std::optional<Tensor> sinks,
                                     std::optional<Tensor> q_positions,
                                     std::optional<Tensor> kv_positions, int64_t ring_pass,
                                     bool placement) {
  aten::NoGradGuard no_grad;
  const Extras ex = extras(cu_seqlens, window, seq_len, per_document, q_positions, kv_positions,
                           ring_pass, placement);
  std::vector<int64_t> lengths;
  Config cfg = agreed_config("ring_sdpa", group_name, {{"q", &q}, {"k", &k}, {"v", &v}},
                             is_causal, load_balanced, scale, backend, rotate, ex, [&] {
                               if (sinks) check_sinks("ring_sdpa", q, *sinks);
                             }, nullptr, lengths);
  finish_config(cfg, ex, q, k, v, lengths);
  auto result = ring_forward(cfg, q, k, v, sinks ? *sinks : Tensor());
  t_agreed = agreed_of(cfg, ex, std::move(lengths));
  return result;
}

// The backward's checks of its extra tensors (the forward's outputs).
void check_backward_tensors(const Tensor& grad_out, const Tensor& q, const Tensor& v,
                            const Tensor& out, const Tensor& lse) {
  CPLIB_CHECK_VALUE(q.dim() == 4 && v.dim() == 4, "cplib.ring_sdpa_backward: expected 4-D q and v",
                    ", got ", q.sizes(), " and ", v.sizes());
  const std::vector<int64_t> out_sizes{q.size(0), q.size(1), q.size(2), v.size(3)};
  const std::vector<int64_t> lse_sizes{q.size(0), q.size(1), q.size(2)};
  CPLIB_CHECK_VALUE(grad_out.sizes().vec() == out_sizes && out.sizes().vec() == out_sizes, "cplib.",
                    "ring_sdpa_backward: grad_out ", grad_out.sizes(), " and out ", out.sizes(),
                    " must have shape ", format_sizes(out_sizes));
  CPLIB_CHECK_VALUE(grad_out.scalar_type() == q.scalar_type() &&
                        out.scalar_type() == q.scalar_type(),
                    "cplib.ring_sdpa_backward: grad_out (", grad_out.scalar_type(), ") and out (",
                    out.scalar_type(), ") must have q's dtype ", q.scalar_type());
  CPLIB_CHECK_VALUE(lse.sizes().vec() == lse_sizes && lse.scalar_type() == acc_dtype(q),
                    "cplib.ring_sdpa_backward: lse must be ", acc_dtype(q), " of shape ",
                    format_sizes(lse_sizes), ", got ", lse.scalar_type(), " ", lse.sizes());
  CPLIB_CHECK_VALUE(grad_out.device() == q.device() && out.device() == q.device() &&
                        lse.device() == q.device(),
                    "cplib.ring_sdpa_backward: grad_out, out and lse must be on ", q.device());
}

std::tuple<Tensor, Tensor, Tensor> backward_impl(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
    const Tensor& lse, const std::string& group_name, bool is_causal, bool load_balanced,
    std::optional<double> scale, int64_t backend, int64_t rotate,
    const std::optional<Tensor>& cu_seqlens, const std::optional<std::vector<int64_t>>& window,
    std::optional<int64_t> seq_len, bool per_document, const std::optional<Tensor>& q_positions,
    const std::optional<Tensor>& kv_positions, const Agreed* covered, bool placement) {
  aten::NoGradGuard no_grad;
  // The backward always runs the pass-KV ring (pass-Q is forward only).
  const Extras ex = extras(cu_seqlens, window, seq_len, per_document, q_positions, kv_positions,
                           kPassKV, placement);
  std::vector<int64_t> lengths;
  Config cfg = agreed_config(
      "ring_sdpa_backward", group_name,
      {{"q", &q}, {"k", &k}, {"v", &v}, {"grad_out", &grad_out}, {"out", &out}, {"lse", &lse}},
      is_causal, load_balanced, scale, backend, rotate, ex,
      [&] { check_backward_tensors(grad_out, q, v, out, lse); }, covered, lengths);
  finish_config(cfg, ex, q, k, v, std::move(lengths), covered);
  return ring_backward(cfg, grad_out, q, k, v, out, lse);
}

std::tuple<Tensor, Tensor, Tensor> ring_sdpa_backward(
    Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, std::string group_name,
    bool is_causal, bool load_balanced, std::optional<double> scale, int64_t backend,
    int64_t rotate, std::optional<Tensor> cu_seqlens, std::optional<std::vector<int64_t>> window,
    std::optional<int64_t> seq_len, bool per_document, std::optional<Tensor> q_positions,
    std::optional<Tensor> kv_positions, int64_t ring_pass, bool placement) {
  (void)ring_pass;
  return backward_impl(grad_out, q, k, v, out, lse, group_name, is_causal, load_balanced, scale,
                       backend, rotate, cu_seqlens, window, seq_len, per_document, q_positions,
                       kv_positions, nullptr, placement);
}

// The backward reached through autograd: its forward's handshake covers it
// (the same group, arguments and shapes; `agreed` is the record of what that
// forward agreed, ring_agreed.h), so it makes none of its own.
std::tuple<Tensor, Tensor, Tensor> ring_sdpa_backward_covered(
    Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, std::string group_name,
    bool is_causal, bool load_balanced, std::optional<double> scale, int64_t backend,
    int64_t rotate, std::optional<Tensor> cu_seqlens, std::optional<std::vector<int64_t>> window,
    std::optional<int64_t> seq_len, bool per_document, std::optional<Tensor> q_positions,
    std::optional<Tensor> kv_positions, int64_t ring_pass, bool placement, Tensor agreed) {
  (void)ring_pass;
  const Agreed a = Agreed::from_record(agreed);
  return backward_impl(grad_out, q, k, v, out, lse, group_name, is_causal, load_balanced, scale,
                       backend, rotate, cu_seqlens, window, seq_len, per_document, q_positions,
                       kv_positions, &a, placement);
}

Tensor ring_agreed_record() { return t_agreed.to_record(); }

int64_t ring_debug_bytes_sent(bool reset) { return bytes_sent(reset); }
int64_t ring_debug_last_pass() { return last_ring_pass(); }
std::vector<int64_t> ring_debug_block_shape() { return last_block_shape(); }

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(cplib_c, m) {
  m.def(
      "ring_sdpa(Tensor q, Tensor k, Tensor v, str group_name, bool is_causal, "
      "bool load_balanced, float? scale, int backend, int rotate, Tensor? cu_seqlens=None, "
      "int[]? window=None, int? seq_len=None, bool per_document=False, "
      "Tensor? sinks=None, Tensor? q_positions=None, Tensor? kv_positions=None, "
      "int ring_pass=0, bool placement=False) -> (Tensor out, Tensor lse)");
  m.def(
      "ring_sdpa_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "str group_name, bool is_causal, bool load_balanced, float? scale, int backend, "
      "int rotate, Tensor? cu_seqlens=None, int[]? window=None, int? seq_len=None, "
      "bool per_document=False, Tensor? q_positions=None, Tensor? kv_positions=None, "
      "int ring_pass=0, bool placement=False) -> (Tensor dq, Tensor dk, Tensor dv)");
  // Internal: the backward through autograd (no handshake; see ring_sdpa_backward_covered).
  m.def(
      "ring_sdpa_backward_covered(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, "
      "Tensor lse, str group_name, bool is_causal, bool load_balanced, float? scale, "
      "int backend, int rotate, Tensor? cu_seqlens, int[]? window, int? seq_len, "
      "bool per_document, Tensor? q_positions, Tensor? kv_positions, int ring_pass, "
      "bool placement, Tensor agreed) -> (Tensor dq, Tensor dk, Tensor dv)");
  // Internal: what the last ring_sdpa of this thread agreed, for its covered backward.
  m.def("ring_agreed_record() -> Tensor");
  // Internal: the handshake of a call on meta tensors (the fake kernels).
  m.def(
      "ring_describe_call(str op, Tensor[] tensors, str group_name, bool is_causal, "
      "bool load_balanced, float? scale, int backend, int rotate, Tensor? cu_seqlens, "
      "int[]? window, int? seq_len, bool per_document, Tensor? q_positions, "
      "Tensor? kv_positions, int ring_pass, bool placement=False) -> ()");
  m.def("ring_debug_bytes_sent(bool reset=False) -> int");
  // The ring pass (0 = kv, 1 = q) the last ring_sdpa ran, "auto" resolved.
  m.def("ring_debug_last_pass() -> int");
  // The block shape the last ring_sdpa (or backward) of this thread resolved
  // its CUDA backend from (computed on every device): [batch, heads, q rows,
  // k/v rows, head dim, v head dim], the same on every rank.
  m.def("ring_debug_block_shape() -> int[]");
}

STABLE_TORCH_LIBRARY_IMPL(cplib_c, CPU, m) {
  m.impl("ring_sdpa", TORCH_BOX(&ring_sdpa));
  m.impl("ring_sdpa_backward", TORCH_BOX(&ring_sdpa_backward));
  m.impl("ring_sdpa_backward_covered", TORCH_BOX(&ring_sdpa_backward_covered));
}

#ifdef CPLIB_WITH_CUDA
STABLE_TORCH_LIBRARY_IMPL(cplib_c, CUDA, m) {
  m.impl("ring_sdpa", TORCH_BOX(&ring_sdpa));
  m.impl("ring_sdpa_backward", TORCH_BOX(&ring_sdpa_backward));
  m.impl("ring_sdpa_backward_covered", TORCH_BOX(&ring_sdpa_backward_covered));
}
#endif

// Ops without tensor arguments dispatch to CompositeExplicitAutograd.
STABLE_TORCH_LIBRARY_IMPL(cplib_c, CompositeExplicitAutograd, m) {
  m.impl("ring_debug_bytes_sent", TORCH_BOX(&ring_debug_bytes_sent));
  m.impl("ring_debug_last_pass", TORCH_BOX(&ring_debug_last_pass));
  m.impl("ring_debug_block_shape", TORCH_BOX(&ring_debug_block_shape));
  m.impl("ring_agreed_record", TORCH_BOX(&ring_agreed_record));
  m.impl("ring_describe_call", TORCH_BOX(&describe_call));
}

}  // namespace cplib::ring
