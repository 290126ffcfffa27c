#include "common/stack.h"

namespace cplib {

void StackReader::check_room() const {
  CPLIB_CHECK(at_ < size_, "cplib.", op_, ": the kernel reads more arguments than the schema's ",
              size_, " (an internal error; please report it)");
}

void StackReader::done() const {
  CPLIB_CHECK(at_ == size_, "cplib.", op_, ": the schema has ", size_,
              " arguments but the kernel read ", at_, " (an internal error; please report it)");
}

}  // namespace cplib
