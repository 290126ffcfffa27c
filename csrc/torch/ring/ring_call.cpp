// The ring call's record and the names of its choices (ring_call.h), and
// cplib_c::ring_choices, which hands those names to Python.
#include "ring/ring_call.h"

#include <algorithm>

#include "common/aten.h"

namespace cplib::ring {
namespace {

template <size_t N>
std::string quoted(const std::array<std::string_view, N>& names) {
  std::string out;
  for (size_t i = 0; i < N; ++i) out += str(i ? ", " : "", "'", names[i], "'");
  return out;
}

// The index of `value` among `names`, or -1 with `unknown` set to the
// message naming it (the first unknown choice of a call).
template <size_t N>
int64_t index_of(std::string_view what, const std::string& value,
                 const std::array<std::string_view, N>& names, std::string& unknown) {
  for (size_t i = 0; i < N; ++i)
    if (names[i] == value) return static_cast<int64_t>(i);
  if (unknown.empty()) unknown = str(what, "='", value, "' is not one of ", quoted(names));
  return -1;
}

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
  return str("rotate=", list(kRotateNames), ";layout=", list(kLayoutNames), ";backend=",
             list(kBackendNames), ";ring_pass=", list(kPassNames));
}

}  // namespace

std::string ring_schema(std::string_view head, std::string_view tail) {
  return str(head, kRingCallArgs, tail);
}

namespace {

template <size_t N>
size_t checked_index(const char* op, const char* what, const std::string& value,
                     const std::array<std::string_view, N>& names) {
  std::string unknown;
  const int64_t i = index_of(what, value, names, unknown);
  CPLIB_CHECK_VALUE(i >= 0, "cplib.", op, ": ", unknown);
  return static_cast<size_t>(i);
}

}  // namespace

Rotate parse_rotate(const char* op, const std::string& name) {
  return static_cast<Rotate>(checked_index(op, "rotate", name, kRotateNames));
}

SeqLayout parse_layout(const char* op, const std::string& name) {
  return static_cast<SeqLayout>(checked_index(op, "layout", name, kLayoutNames));
}

int64_t backend_code(const char* op, const std::string& name) {
  return kBackendCodes[checked_index(op, "backend", name, kBackendNames)];
}

std::string_view backend_name(int64_t code) {
  for (size_t i = 0; i < kBackendCodes.size(); ++i)
    if (kBackendCodes[i] == code) return kBackendNames[i];
  return "?";
}

RingCall RingCall::read(StackReader& in) {
  RingCall c;
  c.group_name = in.next_string();
  c.causal = in.next<bool>();
  c.layout = parse<SeqLayout>("layout", in.next_string(), kLayoutNames, c.unknown);
  c.scale = in.next<std::optional<double>>();
  const int64_t b = index_of("backend", in.next_string(), kBackendNames, c.unknown);
  c.backend = kBackendCodes[static_cast<size_t>(std::max<int64_t>(0, b))];
  c.rotate = parse<Rotate>("rotate", in.next_string(), kRotateNames, c.unknown);
  c.cu_seqlens = in.next<std::optional<Tensor>>();
  c.window = in.next<std::optional<std::vector<int64_t>>>();
  c.seq_len = in.next<std::optional<int64_t>>();
  c.q_positions = in.next<std::optional<Tensor>>();
  c.kv_positions = in.next<std::optional<Tensor>>();
  c.ring_pass = parse<Pass>("ring_pass", in.next_string(), kPassNames, c.unknown);
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
  m.impl("ring_choices", TORCH_BOX(&ring_choices));
}

}  // namespace cplib::ring
