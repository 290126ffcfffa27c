// Reading an op's arguments off its stable stack in a boxed kernel, for ops
// whose arguments are parsed into a record of their own (ring/ring_call.h)
// instead of one C++ parameter each (CPLIB_BOX, box.h).
#pragma once

#include <cstdint>

#include "common/box.h"
#include "common/errors.h"

namespace cplib {

// The arguments in schema order; each read takes the value (the stack's
// reference is the reader's from then on).
class StackReader {
 public:
  StackReader(StableIValue* stack, uint64_t num_args, const char* op)
      : stack_(stack), size_(num_args), op_(op) {}

  // The next argument as T (read<T>, box.h: strings freed).
  template <class T>
  T next() {
    check_room();
    return read<T>(stack_[at_++]);
  }
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
