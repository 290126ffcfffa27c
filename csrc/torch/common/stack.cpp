#include "common/stack.h"

namespace cplib {

std::string StackReader::next_string() {
  check_room();
  auto handle = torch::stable::detail::to<StringHandle>(stack_[at_++]);
  size_t length = 0;
  const char* data = nullptr;
  STABLE_TORCH_ERROR_CODE_CHECK(torch_string_length(handle, &length));
  STABLE_TORCH_ERROR_CODE_CHECK(torch_string_c_str(handle, &data));
  std::string value(data, length);
  STABLE_TORCH_ERROR_CODE_CHECK(torch_delete_string(handle));
  return value;
}

void StackReader::check_room() const {
  CPLIB_CHECK(at_ < size_, "cplib.", op_, ": the kernel reads more arguments than the schema's ",
              size_, " (an internal error; please report it)");
}

void StackReader::done() const {
  CPLIB_CHECK(at_ == size_, "cplib.", op_, ": the schema has ", size_,
              " arguments but the kernel read ", at_, " (an internal error; please report it)");
}

}  // namespace cplib
