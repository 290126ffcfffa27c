// The ring call's record and the names of its choices (ring_call.h), and
// cplib_c::ring_choices, which hands those names to Python.
#include "ring/ring_call.h"

#include <algorithm>

#include "common/aten.h"
#include "common/names.h"

namespace cplib::ring {
namespace {

// The enum E whose values are the indices of `names` (their order is the
// enum's); its first value for an unknown name (then `unknown` says so).
template <class E, size_t N>
E parse(std::string_view what, const std::string& value,
        const std::array<std::string_view, N>& names, std::string& unknown) {
  return static_cast<E>(std::max<int64_t>(0, index_of(what, value, names, unknown)));
}

// "rotate=p2p,alltoall,allgather;layout=...;backend=...;ring_pass=...": every
// choice's names in their order, for cplib/ring/names.py.
std::string ring_choices() {
  auto list = [](const auto& names) {
    std::string out;
    for (const auto& n : names) out += str(out.empty() ? "" : ",", n);
    return out;
  };
  return str("rotate=", list(kRotateNames), ";layout=", list(kLayoutNames),
             ";backend=", list(attention::kBackendNames), ";ring_pass=", list(kPassNames));
}

}  // namespace

std::string ring_schema(std::string_view head, std::string_view tail) {
  return str(head, kRingCallArgs, tail);
}

Rotate parse_rotate(const char* op, const std::string& name) {
  return static_cast<Rotate>(checked_index(op, "rotate", name, kRotateNames));
}

SeqLayout parse_layout(const char* op, const std::string& name) {
  return static_cast<SeqLayout>(checked_index(op, "layout", name, kLayoutNames));
}

RingCall RingCall::read(StackReader& in) {
  RingCall c;
  c.group_name = in.next<std::string>();
  c.causal = in.next<bool>();
  c.layout = parse<SeqLayout>("layout", in.next<std::string>(), kLayoutNames, c.unknown);
  c.scale = in.next<std::optional<double>>();
  const int64_t b = index_of("backend", in.next<std::string>(), attention::kBackendNames,
                             c.unknown);
  c.backend = attention::kBackendCodes[static_cast<size_t>(std::max<int64_t>(0, b))];
  c.rotate = parse<Rotate>("rotate", in.next<std::string>(), kRotateNames, c.unknown);
  c.cu_seqlens = in.next<std::optional<Tensor>>();
  c.window = in.next<std::optional<std::vector<int64_t>>>();
  c.seq_len = in.next<std::optional<int64_t>>();
  c.q_positions = in.next<std::optional<Tensor>>();
  c.kv_positions = in.next<std::optional<Tensor>>();
  c.ring_pass = parse<Pass>("ring_pass", in.next<std::string>(), kPassNames, c.unknown);
  return c;
}

const std::vector<int64_t>& RingCall::cu_seqlens_values() const {
  if (!host.cu_seqlens) host.cu_seqlens = aten::to_host(*cu_seqlens);
  return *host.cu_seqlens;
}

const std::vector<int64_t>& RingCall::q_positions_values() const {
  if (!host.q_positions) host.q_positions = aten::to_host(*q_positions);
  return *host.q_positions;
}

const std::vector<int64_t>& RingCall::kv_positions_values() const {
  if (!host.kv_positions) host.kv_positions = aten::to_host(*kv_positions);
  return *host.kv_positions;
}

STABLE_TORCH_LIBRARY_FRAGMENT(cplib_c, m) {
  // The names of the ring's choices (see ring_call.h), read once by cplib/ring/names.py.
  m.def("ring_choices() -> str");
}

// No tensor arguments: CompositeExplicitAutograd.
STABLE_TORCH_LIBRARY_IMPL(cplib_c, CompositeExplicitAutograd, m) {
  m.impl("ring_choices", CPLIB_BOX(&ring_choices));
}

}  // namespace cplib::ring
