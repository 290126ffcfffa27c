// Any ATen (or other registered) op by name, through torch's stable
// dispatcher entry point: `call("aten::cat", "", tensors, dim)` returns the
// stack, whose first slots hold the op's returns (read them with ret<T>).
//
// torch_call_dispatcher reads as many slots as the RUNNING torch's schema has
// arguments and writes as many as it has returns, not as many as were passed:
// an op that gains trailing optional arguments in a later torch (e.g.
// _flash_attention_forward: 15 on 2.11, 17 on 2.13) would read past a stack
// sized to the call. So pass the longest argument list any supported torch
// has (an older torch ignores the extra slots; pass only values that own
// nothing there, such as nullopt or ints), and the stack always has at least
// kMinStackSlots slots, zero (None) beyond what was passed.
//
// The stable call cannot return a SymInt/SymBool/SymFloat (torch 2.11-2.15:
// "Expected Tensor but got Int"): never call an op whose schema returns one
// (tests/comm/test_cuda_glue.py audits every "aten::" name in csrc/).
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>

#include <torch/csrc/stable/c/shim.h>
#include <torch/csrc/stable/stableivalue_conversions.h>

#include "common/box.h"

namespace cplib {

// More than any schema cplib calls reads or writes (the longest, flash's
// forward on torch 2.13, has 17 arguments).
constexpr size_t kMinStackSlots = 24;

// Raises RuntimeError naming the op when the dispatcher call failed (torch
// logs the op's own message on stderr; the stable ABI does not pass it on).
void check_dispatch(int status, const char* name, const char* overload);

template <size_t Returns = 1, class... Args>
auto call(const char* name, const char* overload, const Args&... args) {
  constexpr size_t n = std::max({sizeof...(Args), Returns, kMinStackSlots});
  std::array<StableIValue, n> stack{torch::stable::detail::from(args)...};
  check_dispatch(torch_call_dispatcher(name, overload, stack.data(), TORCH_ABI_VERSION), name,
                 overload);
  return stack;
}

// A return slot's value (strings freed: box.h).
template <class T>
T ret(StableIValue v) {
  return read<T>(v);
}

}  // namespace cplib
