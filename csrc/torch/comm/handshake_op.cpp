// The handshake as ops, for the Python side: `handshake` describes a call
// made of Python checks and tensors (sharding, context_parallel, Ulysses'
// exchange of ranks of different lengths: `skip_dim`, the dim left out of
// the comparison) and returns every rank's local lengths; `handshake_error` is a wrapper's own
// invalid argument, joining the handshake that the other ranks' op is in; `handshake_set_route` is
// where cplib/comm/native.py says which group carries a group's handshakes (by the group's token),
// and `handshake_debug_route` what the handshake then uses (the route's group and the record
// buffer's device type), so that a test can check without a GPU that CUDA tensors are handshaken on
// the host.
#include <algorithm>

#include "comm/handshake.h"

namespace cplib {
namespace {

ErrorKind error_kind(const std::string& name) {
  if (name == "NotImplementedError") return ErrorKind::not_implemented;
  if (name == "TypeError") return ErrorKind::type;
  if (name == "IndexError") return ErrorKind::index;
  if (name == "ValueError") return ErrorKind::value;
  return ErrorKind::runtime;
}

std::vector<int64_t> handshake(std::string group_name, std::string op, std::vector<Tensor> tensors,
                               std::vector<std::string> tensor_names,
                               std::vector<std::string> names, std::vector<int64_t> values,
                               std::vector<int64_t> lengths, int64_t skip_dim) {
  CPLIB_CHECK_VALUE(tensors.size() == tensor_names.size() && names.size() == values.size() &&
                        static_cast<int64_t>(lengths.size()) <= Handshake::kMaxLengths,
                    "cplib.handshake: mismatched descriptions");
  const Group group = resolve_group(group_name);
  Handshake hs(op);
  for (size_t i = 0; i < tensors.size(); ++i)
    hs.sig().add_meta(tensor_names[i], tensors[i], skip_dim);
  for (size_t i = 0; i < names.size(); ++i) hs.sig().add(names[i], values[i]);
  hs.sig().add("the number of local lengths", static_cast<int64_t>(lengths.size()));
  const int64_t count = static_cast<int64_t>(lengths.size());
  hs.set_lengths(std::move(lengths));
  hs.exchange(group);
  std::vector<int64_t> table;
  for (int64_t r = 0; r < group.size; ++r) {
    const std::vector<int64_t> l = hs.exchanged() ? hs.lengths(r) : hs.lengths(0);
    table.insert(table.end(), l.begin(), l.begin() + std::min<int64_t>(count, l.size()));
  }
  return table;
}

void handshake_error(std::string group_name, std::string op, std::string kind,
                     std::string message) {
  const Group group = resolve_group(group_name);
  Handshake hs(op);
  hs.fail(error_kind(kind), message);
  hs.exchange(group);
}

void handshake_set_route(int64_t token, std::string via, int64_t on_host, bool side) {
  CPLIB_CHECK_VALUE(on_host >= -1 && on_host <= 1, "cplib.handshake_set_route: on_host=", on_host,
                    " must be -1, 0 or 1");
  register_handshake_group(token, via, on_host, side);
}

std::vector<std::string> handshake_debug_route(std::string group_name) {
  const HandshakeRoute r = handshake_route(resolve_group(group_name));
  return {r.via.name, r.device.type() == DeviceType::CPU ? "cpu" : "cuda"};
}

int64_t handshake_debug_count(bool reset) { return handshake_count(reset); }

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(cplib_c, m) {
  m.def(
      "handshake(str group_name, str op, Tensor[] tensors, str[] tensor_names, str[] names, "
      "int[] values, int[] lengths, int skip_dim=-1) -> int[]");
  m.def("handshake_error(str group_name, str op, str kind, str message) -> ()");
  m.def("handshake_set_route(int token, str via, int on_host, bool side) -> ()");
  m.def("handshake_debug_route(str group_name) -> str[]");
  m.def("handshake_debug_count(bool reset=False) -> int");
}

// Ops without tensor arguments dispatch to CompositeExplicitAutograd.
STABLE_TORCH_LIBRARY_IMPL(cplib_c, CompositeExplicitAutograd, m) {
  m.impl("handshake", CPLIB_BOX(&handshake));
  m.impl("handshake_error", CPLIB_BOX(&handshake_error));
  m.impl("handshake_set_route", CPLIB_BOX(&handshake_set_route));
  m.impl("handshake_debug_route", CPLIB_BOX(&handshake_debug_route));
  m.impl("handshake_debug_count", CPLIB_BOX(&handshake_debug_count));
}

}  // namespace cplib
