// Any ATen (or other registered) op by name, through torch's stable
// dispatcher entry point: `call("aten::cat", "", tensors, dim)` returns the
// stack, whose first slots hold the op's returns (read them with ret<T>).
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>

#include <torch/csrc/stable/c/shim.h>
#include <torch/csrc/stable/stableivalue_conversions.h>

namespace cplib {

// Raises RuntimeError naming the op when the dispatcher call failed (torch
// logs the op's own message on stderr; the stable ABI does not pass it on).
void check_dispatch(int status, const char* name, const char* overload);

template <size_t Returns = 1, class... Args>
auto call(const char* name, const char* overload, const Args&... args) {
  constexpr size_t n = std::max(sizeof...(Args), Returns);
  std::array<StableIValue, n> stack{torch::stable::detail::from(args)...};
  check_dispatch(torch_call_dispatcher(name, overload, stack.data(), TORCH_ABI_VERSION), name,
                 overload);
  return stack;
}

template <class T>
T ret(StableIValue v) {
  return torch::stable::detail::to<T>(v);
}

}  // namespace cplib
