// The handshake as ops, for the Python side: `handshake` describes a call
// made of Python checks and tensors (sharding, context_parallel) and returns
// every rank's local lengths; `handshake_error` is a wrapper's own invalid
// argument, joining the handshake that the other ranks' op is in.
#include <torch/library.h>

#include "comm/handshake.h"

namespace cplib {
namespace {

std::string str(c10::string_view s) { return {s.data(), s.size()}; }

ErrorKind error_kind(c10::string_view name) {
  const std::string n = str(name);
  if (n == "NotImplementedError") return ErrorKind::not_implemented;
  if (n == "TypeError") return ErrorKind::type;
  if (n == "IndexError") return ErrorKind::index;
  if (n == "ValueError") return ErrorKind::value;
  return ErrorKind::runtime;
}

std::vector<int64_t> handshake(c10::string_view group_name, c10::string_view op,
                               at::TensorList tensors, std::vector<std::string> tensor_names,
                               std::vector<std::string> names, std::vector<int64_t> values,
                               std::vector<int64_t> lengths) {
  TORCH_CHECK_VALUE(tensors.size() == tensor_names.size() && names.size() == values.size() &&
                        static_cast<int64_t>(lengths.size()) <= Handshake::kMaxLengths,
                    "cplib.handshake: mismatched descriptions");
  PG pg = resolve_group(std::string_view(group_name.data(), group_name.size()));
  Handshake hs(str(op));
  for (size_t i = 0; i < tensors.size(); ++i) hs.sig().add_meta(tensor_names[i], tensors[i]);
  for (size_t i = 0; i < names.size(); ++i) hs.sig().add(names[i], values[i]);
  hs.sig().add("the number of local lengths", static_cast<int64_t>(lengths.size()));
  const int64_t count = static_cast<int64_t>(lengths.size());
  hs.set_lengths(std::move(lengths));
  hs.exchange(std::string_view(group_name.data(), group_name.size()), pg,
              tensors.empty() ? at::Device(at::kCPU) : tensors[0].device());
  std::vector<int64_t> table;
  for (int64_t r = 0; r < pg->getSize(); ++r) {
    const std::vector<int64_t> l = hs.exchanged() ? hs.lengths(r) : hs.lengths(0);
    table.insert(table.end(), l.begin(), l.begin() + std::min<int64_t>(count, l.size()));
  }
  return table;
}

void handshake_error(c10::string_view group_name, c10::string_view op, c10::string_view kind,
                     c10::string_view message) {
  PG pg = resolve_group(std::string_view(group_name.data(), group_name.size()));
  Handshake hs(str(op));
  hs.fail(error_kind(kind), str(message));
  hs.exchange(std::string_view(group_name.data(), group_name.size()), pg, at::Device(at::kCPU));
}

void handshake_group(c10::string_view group_name, c10::string_view via) {
  register_handshake_group(str(group_name), str(via));
}

bool handshake_enabled_op() { return handshake_enabled(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(cplib_c, m) {
  m.def(
      "handshake(str group_name, str op, Tensor[] tensors, str[] tensor_names, str[] names, "
      "int[] values, int[] lengths) -> int[]",
      &handshake);
  m.def("handshake_error(str group_name, str op, str kind, str message) -> ()", &handshake_error);
  m.def("handshake_group(str group_name, str via) -> ()", &handshake_group);
  m.def("handshake_enabled() -> bool", &handshake_enabled_op);
}

}  // namespace cplib
