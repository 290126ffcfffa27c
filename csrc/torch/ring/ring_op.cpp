// cplib_c::ring_sdpa / ring_sdpa_backward: ring attention over a process
// group. Each op's schema is its tensors plus the ring call's arguments
// (ring_call.h), read once into a RingCall that the ring takes down; and a
// debug counter of the bytes the rings have sent.
#include <initializer_list>

#include "attention/sinks.h"
#include "comm/handshake.h"
#include "common/format.h"
#include "ring/ring_agreed.h"
#include "ring/ring_forward.h"
#include "ring/ring_lengths.h"
#include "ring/ring_placement.h"
#include "ring/ring_rotate.h"

namespace cplib::ring {
namespace {

using NamedTensors = std::initializer_list<std::pair<const char*, const Tensor*>>;

// "layout (0 = sequential, 1 = head_tail, ...)": a choice's field in the
// handshake, named with its values' meanings for the error message.
template <class Names, class Codes>
std::string legend(const char* what, const Names& names, const Codes& codes) {
  std::string out = str(what, " (");
  for (size_t i = 0; i < names.size(); ++i) out += str(i ? ", " : "", codes[i], " = ", names[i]);
  return out + ")";
}

template <size_t N>
std::array<int64_t, N> indices() {
  std::array<int64_t, N> out{};
  for (size_t i = 0; i < N; ++i) out[i] = static_cast<int64_t>(i);
  return out;
}

// What every rank of the ring must agree on, one line per argument. With
// seq_len, a document layout, explicit positions or no causal mask the local
// lengths may differ by design (uneven shards, joint text+image streams), so
// dim 2 is left out: the local checks and learn_local_lengths cover it.
// `bounds`: cu_seqlens as the checks already read them to the host (no
// second read of a device tensor); null where they were not read (meta).
void describe(CallSignature& sig, NamedTensors tensors, const RingCall& call,
              const std::vector<int64_t>* bounds, const Placement* placed = nullptr) {
  static const std::string kLayout = legend("layout", kLayoutNames, indices<4>());
  static const std::string kRotate = legend("rotate", kRotateNames, indices<3>());
  static const std::string kPass = legend("ring_pass", kPassNames, indices<3>());
  static const std::string kBackend = legend("backend", attention::kBackendNames,
                                             attention::kBackendCodes);
  // The device first: a rank on other tensors (meta beside CPU, say) differs
  // in everything after it, and this names the cause.
  const Tensor& q = *tensors.begin()->second;
  sig.add("q.device type", static_cast<int64_t>(q.device().type()), FieldKind::device);
  sig.add("seq_len", call.seq_len.value_or(-1));
  sig.add_flag("window is not None", call.window.has_value());
  for (size_t i = 0; call.window && i < call.window->size(); ++i)
    sig.add("window[" + std::to_string(i) + "]", (*call.window)[i]);
  sig.add(kLayout, static_cast<int64_t>(call.layout));
  sig.add_flag("cu_seqlens is not None", call.cu_seqlens.has_value());
  if (call.cu_seqlens) {
    if (bounds)
      sig.add_values_hash("cu_seqlens", *bounds);
    else
      sig.add_values_hash("cu_seqlens", *call.cu_seqlens);
  }
  // The placement each rank computed (the same function of cu_seqlens and N
  // everywhere, unless the ranks run different builds).
  if (placed) sig.add_values_hash("document placement", flatten(*placed));
  sig.add_flag("q_positions is not None", call.q_positions.has_value());
  sig.add_flag("kv_positions is not None", call.kv_positions.has_value());
  sig.add(kPass, static_cast<int64_t>(call.ring_pass));
  sig.add_flag("is_causal", call.causal);
  sig.add_optional_float("scale", call.scale);
  sig.add(kBackend, call.backend);
  sig.add(kRotate, static_cast<int64_t>(call.rotate));
  // The tensors last: a flag that differs is named before the shapes it implies.
  // Lengths that may differ across ranks travel on their own (learn_local_lengths):
  // non-causal calls, and sequential and head-tail ones, which derive S from them.
  const bool uneven = call.seq_len || call.layout == SeqLayout::per_document ||
                      call.has_positions() || !call.causal ||
                      call.layout == SeqLayout::sequential || call.layout == SeqLayout::head_tail;
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
// autograd) there is no handshake, the group is the forward's, and the
// checks run on the forward's values (its documents and positions, as it
// read them), which passed its handshake on every rank: nothing is re-read
// that could fail on one rank alone. `learned`: every rank's {q rows, k/v
// rows}, when exchanged.
template <class F>
Config agreed_config(const char* op, const RingCall& call, NamedTensors tensors, F&& more_checks,
                     const Agreed* covered, std::vector<int64_t>& learned) {
  const Group group = covered ? covered->group(call.group_name) : resolve_group(call.group_name);
  const Tensor& q = *tensors.begin()->second;
  const Tensor& k = *(tensors.begin() + 1)->second;
  const Tensor& v = *(tensors.begin() + 2)->second;
  Config cfg;
  auto checks = [&] {
    more_checks();
    cfg = check_args(op, q, k, v, group, call);
  };
  std::vector<int64_t> table;  // rank-major {q rows, k/v rows}, when exchanged
  if (covered) {
    if (covered->has_bounds) call.host.cu_seqlens = covered->bounds;
    if (static_cast<int64_t>(covered->q_positions.size()) > group.rank) {
      call.host.q_positions = covered->q_positions[group.rank];
      call.host.kv_positions = covered->kv_positions[group.rank];
    }
    checks();
    table = covered->lengths;
  } else {
    Handshake hs(op);
    hs.validate([&] {
      checks();
      describe(hs.sig(), tensors, call, &cfg.mask.bounds, cfg.q_layout.placed.get());
      hs.set_lengths({q.size(2), k.size(2)});
    });
    hs.exchange(group);
    for (int64_t r = 0; hs.exchanged() && r < group.size; ++r) {
      const std::vector<int64_t> l = hs.lengths(r);
      table.insert(table.end(), l.begin(), l.end());
    }
  }
  // Explicit positions keep the table for gathering them (finish_config).
  if (!call.has_positions()) learn_local_lengths(op, cfg, q, k, call, table);
  learned = std::move(table);
  return cfg;
}

// ring_sdpa(q, k, v, <call>, sinks) -> (out, lse).
void ring_sdpa(StableIValue* stack, uint64_t num_args, uint64_t) {
  StackReader in(stack, num_args, "ring_sdpa");
  const Tensor q = in.next<Tensor>(), k = in.next<Tensor>(), v = in.next<Tensor>();
  const RingCall call = RingCall::read(in);
  const std::optional<Tensor> sinks = in.next<std::optional<Tensor>>();
  in.done();
  aten::NoGradGuard no_grad;
  std::vector<int64_t> lengths;
  Config cfg = agreed_config(
      "ring_sdpa", call, {{"q", &q}, {"k", &k}, {"v", &v}},
      [&] {
        if (sinks) attention::check_sinks("ring_sdpa", q, *sinks);
      },
      nullptr, lengths);
  finish_config(cfg, call, q, k, v, lengths);
  auto [out, lse] = ring_forward(cfg, q, k, v, sinks ? *sinks : Tensor());
  t_agreed = agreed_of(cfg, call, std::move(lengths));
  stack[0] = torch::stable::detail::from(out);
  stack[1] = torch::stable::detail::from(lse);
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
  CPLIB_CHECK_VALUE(
      grad_out.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
      "cplib.ring_sdpa_backward: grad_out (", grad_out.scalar_type(), ") and out (",
      out.scalar_type(), ") must have q's dtype ", q.scalar_type());
  CPLIB_CHECK_VALUE(lse.sizes().vec() == lse_sizes && lse.scalar_type() == attention::acc_dtype(q),
                    "cplib.ring_sdpa_backward: lse must be ", attention::acc_dtype(q), " of shape ",
                    format_sizes(lse_sizes), ", got ", lse.scalar_type(), " ", lse.sizes());
  CPLIB_CHECK_VALUE(
      grad_out.device() == q.device() && out.device() == q.device() && lse.device() == q.device(),
      "cplib.ring_sdpa_backward: grad_out, out and lse must be on ", q.device());
}

// [agreed,] grad_out, q, k, v, out, lse, <call> -> (dq, dk, dv). With the
// record `agreed` (ring_sdpa_backward_covered: the backward through
// autograd) its forward's handshake covers it (the same group, arguments and
// shapes), so it makes none of its own.
void backward(StableIValue* stack, uint64_t num_args, bool covered) {
  StackReader in(stack, num_args, covered ? "ring_sdpa_backward_covered" : "ring_sdpa_backward");
  const Tensor record = covered ? in.next<Tensor>() : Tensor();
  const Tensor grad_out = in.next<Tensor>(), q = in.next<Tensor>(), k = in.next<Tensor>(),
               v = in.next<Tensor>(), out = in.next<Tensor>(), lse = in.next<Tensor>();
  RingCall call = RingCall::read(in);
  in.done();
  const std::optional<Agreed> agreed = covered ? std::optional<Agreed>(Agreed::from_record(record))
                                               : std::nullopt;
  // The backward always runs the pass-KV ring (pass-Q is forward only).
  call.ring_pass = Pass::kv;
  aten::NoGradGuard no_grad;
  std::vector<int64_t> lengths;
  Config cfg = agreed_config(
      "ring_sdpa_backward", call,
      {{"q", &q}, {"k", &k}, {"v", &v}, {"grad_out", &grad_out}, {"out", &out}, {"lse", &lse}},
      [&] { check_backward_tensors(grad_out, q, v, out, lse); }, agreed ? &*agreed : nullptr,
      lengths);
  finish_config(cfg, call, q, k, v, std::move(lengths), agreed ? &*agreed : nullptr);
  auto [dq, dk, dv] = ring_backward(cfg, grad_out, q, k, v, out, lse);
  stack[0] = torch::stable::detail::from(dq);
  stack[1] = torch::stable::detail::from(dk);
  stack[2] = torch::stable::detail::from(dv);
}

void ring_sdpa_backward(StableIValue* stack, uint64_t num_args, uint64_t) {
  backward(stack, num_args, false);
}

void ring_sdpa_backward_covered(StableIValue* stack, uint64_t num_args, uint64_t) {
  backward(stack, num_args, true);
}

// ring_describe_call(op, tensors, <call>): the handshake of a call on meta
// tensors, which compute nothing (the fake kernel does): a rank on meta
// tensors beside ranks on real ones meets them in the handshake, so every
// rank raises the same error naming the device, instead of the real ranks
// waiting for a rank that never communicates. The Python checks of the fake
// kernel ran before (their errors join the handshake through
// cplib_c::handshake_error).
void describe_call(StableIValue* stack, uint64_t num_args, uint64_t) {
  StackReader in(stack, num_args, "ring_describe_call");
  const std::string op = in.next<std::string>();
  const std::vector<Tensor> tensors = in.next<std::vector<Tensor>>();
  RingCall call = RingCall::read(in);
  in.done();
  CPLIB_CHECK_VALUE(op == "ring_sdpa" || op == "ring_sdpa_backward",
                    "cplib.ring_describe_call: unknown op '", op, "'");
  CPLIB_CHECK_VALUE(tensors.size() == (op == "ring_sdpa" ? 3u : 6u), "cplib.", op, ": ",
                    tensors.size(), " tensors to describe");
  if (op != "ring_sdpa") call.ring_pass = Pass::kv;
  const Group group = resolve_group(call.group_name);
  Handshake hs(op);
  hs.validate([&] {
    if (tensors.size() == 3)
      describe(hs.sig(), {{"q", &tensors[0]}, {"k", &tensors[1]}, {"v", &tensors[2]}}, call,
               nullptr);
    else
      describe(hs.sig(),
               {{"q", &tensors[1]},
                {"k", &tensors[2]},
                {"v", &tensors[3]},
                {"grad_out", &tensors[0]},
                {"out", &tensors[4]},
                {"lse", &tensors[5]}},
               call, nullptr);
    const Tensor& q = tensors[tensors.size() == 3 ? 0 : 1];
    const Tensor& k = tensors[tensors.size() == 3 ? 1 : 2];
    hs.set_lengths({q.size(2), k.size(2)});
  });
  hs.exchange(group);
}

Tensor ring_agreed_record() { return t_agreed.to_record(); }

int64_t ring_debug_bytes_sent(bool reset) { return bytes_sent(reset); }
std::string ring_debug_last_pass() {
  return std::string(kPassNames[static_cast<size_t>(last_ring_pass())]);
}
std::vector<int64_t> ring_debug_block_shape() { return last_block_shape(); }

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(cplib_c, m) {
  m.def(ring_schema("ring_sdpa(Tensor q, Tensor k, Tensor v, ",
                    ", Tensor? sinks=None) -> (Tensor out, Tensor lse)")
            .c_str());
  m.def(ring_schema("ring_sdpa_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, "
                    "Tensor out, Tensor lse, ",
                    ") -> (Tensor dq, Tensor dk, Tensor dv)")
            .c_str());
  // Internal: the backward through autograd (no handshake; see backward()).
  m.def(ring_schema("ring_sdpa_backward_covered(Tensor agreed, Tensor grad_out, Tensor q, "
                    "Tensor k, Tensor v, Tensor out, Tensor lse, ",
                    ") -> (Tensor dq, Tensor dk, Tensor dv)")
            .c_str());
  // Internal: what the last ring_sdpa of this thread agreed, for its covered backward.
  m.def("ring_agreed_record() -> Tensor");
  // Internal: the handshake of a call on meta tensors (the fake kernels).
  m.def(ring_schema("ring_describe_call(str op, Tensor[] tensors, ", ") -> ()").c_str());
  m.def("ring_debug_bytes_sent(bool reset=False) -> int");
  // The ring pass ("kv" or "q") the last ring_sdpa ran, "auto" resolved.
  m.def("ring_debug_last_pass() -> str");
  // The block shape the last ring_sdpa (or backward) of this thread resolved
  // its CUDA backend from (computed on every device): [batch, heads, q rows,
  // k/v rows, head dim, v head dim], the same on every rank.
  m.def("ring_debug_block_shape() -> int[]");
}

STABLE_TORCH_LIBRARY_IMPL(cplib_c, CPU, m) {
  m.impl("ring_sdpa", &ring_sdpa);
  m.impl("ring_sdpa_backward", &ring_sdpa_backward);
  m.impl("ring_sdpa_backward_covered", &ring_sdpa_backward_covered);
}

#ifdef CPLIB_WITH_CUDA
STABLE_TORCH_LIBRARY_IMPL(cplib_c, CUDA, m) {
  m.impl("ring_sdpa", &ring_sdpa);
  m.impl("ring_sdpa_backward", &ring_sdpa_backward);
  m.impl("ring_sdpa_backward_covered", &ring_sdpa_backward_covered);
}
#endif

// Ops without tensor arguments dispatch to CompositeExplicitAutograd.
STABLE_TORCH_LIBRARY_IMPL(cplib_c, CompositeExplicitAutograd, m) {
  m.impl("ring_debug_bytes_sent", CPLIB_BOX(&ring_debug_bytes_sent));
  m.impl("ring_debug_last_pass", CPLIB_BOX(&ring_debug_last_pass));
  m.impl("ring_debug_block_shape", CPLIB_BOX(&ring_debug_block_shape));
  m.impl("ring_agreed_record", CPLIB_BOX(&ring_agreed_record));
  m.impl("ring_describe_call", &describe_call);
}

}  // namespace cplib::ring
