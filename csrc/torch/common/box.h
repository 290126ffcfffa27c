// Reading values off a stable stack, and the boxed kernels of cplib's ops.
//
// torch's stable conversion of a `str` (stableivalue_conversions.h, the
// headers of torch 2.11 to 2.13 at least; fixed in 2.15) copies the string
// into a `new std::string` it never frees. Compiled into cplib through
// TORCH_BOX, it leaked a copy of every string argument of every op call
// (the group name of every decode step; 100 KB per call for a 100 KB
// name). So cplib reads each argument with read<T>, which reads strings
// (`str`, `str[]`) itself and frees their handles, and leaves every other
// type to torch; every op registers through CPLIB_BOX (TORCH_BOX with
// read<T>), and StackReader (stack.h) and ret<T> (dispatch.h) read through
// read<T> too.
//
// The same conversion compiled into libtorch (2.11 to 2.14) leaks the
// strings cplib passes INTO the dispatcher (call(), dispatch.h): cplib
// passes none on per-step paths except the collectives' group name
// (comm/collectives.h), and aten::pad's mode is avoided (aten::pad_last).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/csrc/stable/stableivalue_conversions.h>

namespace cplib {

// A `str` slot's value; the slot's string is freed.
std::string read_string(StableIValue v);
// A `str[]` slot's values; the list and its strings are freed.
std::vector<std::string> read_strings(StableIValue v);

namespace box_detail {

// Whether T holds a std::string torch would convert (leaking it).
template <class T>
struct HoldsString : std::is_same<T, std::string> {};
template <class T>
struct HoldsString<std::optional<T>> : HoldsString<T> {};
template <class T>
struct HoldsString<std::vector<T>> : HoldsString<T> {};

}  // namespace box_detail

// The value of a stack slot as T, taking ownership of what the slot holds.
template <class T>
T read(StableIValue v) {
  if constexpr (std::is_same_v<T, std::string>) {
    return read_string(v);
  } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
    return read_strings(v);
  } else {
    static_assert(!box_detail::HoldsString<T>::value,
                  "cplib::read: a string inside this type needs a reader of its own (box.h)");
    return torch::stable::detail::to<T>(v);
  }
}

namespace box_detail {

// The type a parameter's value is read as: without const and reference,
// and owning (a string for a string_view, a vector for an array ref), as
// TORCH_BOX reads it.
template <class T>
struct Owned {
  using type = T;
};
template <>
struct Owned<std::string_view> {
  using type = std::string;
};
template <class T>
struct Owned<torch::headeronly::HeaderOnlyArrayRef<T>> {
  using type = std::vector<T>;
};
template <class T>
using owned_t = typename Owned<std::remove_cv_t<std::remove_reference_t<T>>>::type;

// Raises unless the schema's argument and return counts are the kernel's.
void check_counts(uint64_t num_args, uint64_t num_outputs, size_t params, size_t returns);

template <class T>
struct IsTuple : std::false_type {};
template <class... R>
struct IsTuple<std::tuple<R...>> : std::true_type {};

template <class R>
constexpr size_t return_count() {
  if constexpr (std::is_void_v<R>)
    return 0;
  else if constexpr (IsTuple<R>::value)
    return std::tuple_size_v<R>;
  else
    return 1;
}

// The returns into the stack's first slots.
template <class R>
void write(StableIValue* stack, const R& result) {
  if constexpr (IsTuple<R>::value) {
    std::apply(
        [stack](const auto&... r) {
          size_t i = 0;
          ((stack[i++] = torch::stable::detail::from(r)), ...);
        },
        result);
  } else {
    stack[0] = torch::stable::detail::from(result);
  }
}

template <auto F>
struct Boxed;

template <class R, class... P, R (*F)(P...)>
struct Boxed<F> {
  template <size_t... I>
  static R invoke(StableIValue* stack, std::index_sequence<I...>) {
    // Braced: the slots are read in order, each into the value F is called with.
    std::tuple<owned_t<P>...> args{read<owned_t<P>>(stack[I])...};
    return std::apply(F, std::move(args));
  }

  static void kernel(StableIValue* stack, uint64_t num_args, uint64_t num_outputs) {
    check_counts(num_args, num_outputs, sizeof...(P), return_count<R>());
    if constexpr (std::is_void_v<R>)
      invoke(stack, std::index_sequence_for<P...>());
    else
      write(stack, invoke(stack, std::index_sequence_for<P...>()));
  }
};

}  // namespace box_detail
}  // namespace cplib

// The boxed kernel of a C++ function, for STABLE_TORCH_LIBRARY_IMPL's
// m.impl: CPLIB_BOX(&fn) where torch's examples write TORCH_BOX(&fn).
#define CPLIB_BOX(func) (::cplib::box_detail::Boxed<func>::kernel)
