// Reading an op's arguments off its stable stack in a boxed kernel, for ops
// whose arguments are parsed into a record of their own (ring/ring_call.h)
// instead of one C++ parameter each (TORCH_BOX).
#pragma once

#include <cstdint>
#include <string>

#include <torch/csrc/stable/stableivalue_conversions.h>

#include "common/errors.h"

namespace cplib {

// The arguments in schema order; each read takes the value (the stack's
// reference is the reader's from then on).
class StackReader {
 public:
  StackReader(StableIValue* stack, uint64_t num_args, const char* op)
      : stack_(stack), size_(num_args), op_(op) {}

  template <class T>
  T next() {
    check_room();
    return torch::stable::detail::to<T>(stack_[at_++]);
  }
  // A `str` argument. (torch's std::string conversion allocates a copy it
  // never frees; an op called once per layer would leak on every call.)
  std::string next_string();
  // Raises unless every argument was read: the schema and the reader agree.
  void done() const;
  const char* op() const { return op_; }

 private:
  void check_room() const;

  StableIValue* stack_;
  uint64_t size_;
  uint64_t at_ = 0;
  const char* op_;
};

}  // namespace cplib
