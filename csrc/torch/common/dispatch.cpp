#include "common/dispatch.h"

#include <dlfcn.h>

#include <string>

#include "common/errors.h"

namespace cplib {
namespace {

// torch >= 2.13 keeps the failed call's message per thread, behind a symbol
// that is not part of the stable ABI; it is looked up at run time, and torch
// 2.11 (which logs the message instead) goes without it.
using LastMessageFn = const std::string& (*)();

LastMessageFn last_message_fn() {
  static const LastMessageFn fn = reinterpret_cast<LastMessageFn>(
      dlsym(RTLD_DEFAULT,
            "_ZN5torch4csrc4shim7details42get_torch_exception_what_without_backtraceB5cxx11Ev"));
  return fn;
}

}  // namespace

void check_dispatch(int status, const char* name, const char* overload) {
  if (status == TORCH_SUCCESS) return;
  const std::string op = std::string(name) + (*overload ? "." : "") + overload;
  if (LastMessageFn fn = last_message_fn()) raise(ErrorKind::runtime, op + ": " + fn());
  raise(ErrorKind::runtime, "cplib: " + op + " failed (its error is logged above)");
}

}  // namespace cplib
