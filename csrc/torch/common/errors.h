// cplib's errors on the stable ABI. A kernel's exception reaches Python as a
// RuntimeError carrying what(); what() starts with the Python class to raise
// ("ValueError: ..."), and cplib's Python layer raises that class
// (cplib/comm/native.py: native_errors). The handshake carries kind and message apart.
#pragma once

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>

namespace cplib {

// Error classes carried on the wire (and raised as the same Python class).
enum class ErrorKind : int64_t { none = 0, value, not_implemented, type, index, runtime };

// The Python class of `kind`, as the prefix of what() names it.
const char* python_class(ErrorKind kind);

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message);
  ErrorKind kind() const { return kind_; }
  const std::string& message() const { return message_; }

 private:
  ErrorKind kind_;
  std::string message_;
};

template <class... Args>
std::string str(const Args&... args) {
  std::ostringstream os;
  ((os << args), ...);
  return os.str();
}

[[noreturn]] inline void raise(ErrorKind kind, const std::string& message) {
  throw Error(kind, message);
}

}  // namespace cplib

#define CPLIB_CHECK_KIND(kind, cond, ...)                         \
  do {                                                            \
    if (!(cond)) ::cplib::raise(kind, ::cplib::str(__VA_ARGS__)); \
  } while (0)
// ValueError / NotImplementedError / TypeError / RuntimeError naming the value.
#define CPLIB_CHECK_VALUE(cond, ...) CPLIB_CHECK_KIND(::cplib::ErrorKind::value, cond, __VA_ARGS__)
#define CPLIB_CHECK_NOT_IMPLEMENTED(cond, ...) \
  CPLIB_CHECK_KIND(::cplib::ErrorKind::not_implemented, cond, __VA_ARGS__)
#define CPLIB_CHECK_TYPE(cond, ...) CPLIB_CHECK_KIND(::cplib::ErrorKind::type, cond, __VA_ARGS__)
#define CPLIB_CHECK(cond, ...) CPLIB_CHECK_KIND(::cplib::ErrorKind::runtime, cond, __VA_ARGS__)
// A broken invariant of cplib itself, not of the input.
#define CPLIB_ASSERT(cond)                                                                   \
  CPLIB_CHECK_KIND(::cplib::ErrorKind::runtime, cond, "cplib internal error: ", #cond, " (", \
                   __FILE__, ":", __LINE__, "); please report it")
