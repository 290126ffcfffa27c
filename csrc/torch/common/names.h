// Choices by name: a value among a fixed list of names (a rotation, a
// layout, a backend), found by index, with the error that names the value
// and the valid ones.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "common/errors.h"

namespace cplib {

// 'a', 'b', 'c'
template <size_t N>
std::string quoted(const std::array<std::string_view, N>& names) {
  std::string out;
  for (size_t i = 0; i < N; ++i) out += str(i ? ", " : "", "'", names[i], "'");
  return out;
}

// The index of `value` among `names`, or -1 with `unknown` set to the
// message naming it (when `unknown` is still empty: the first unknown
// choice of a call is the one reported).
template <size_t N>
int64_t index_of(std::string_view what, const std::string& value,
                 const std::array<std::string_view, N>& names, std::string& unknown) {
  for (size_t i = 0; i < N; ++i)
    if (names[i] == value) return static_cast<int64_t>(i);
  if (unknown.empty()) unknown = str(what, "='", value, "' is not one of ", quoted(names));
  return -1;
}

// The index of `value` among `names`; ValueError naming `op`, the value and
// the valid names when it is none of them.
template <size_t N>
size_t checked_index(const char* op, const char* what, const std::string& value,
                     const std::array<std::string_view, N>& names) {
  std::string unknown;
  const int64_t i = index_of(what, value, names, unknown);
  CPLIB_CHECK_VALUE(i >= 0, "cplib.", op, ": ", unknown);
  return static_cast<size_t>(i);
}

}  // namespace cplib
