#include "common/box.h"

#include "common/errors.h"

namespace cplib {

std::string read_string(StableIValue v) {
  auto handle = torch::stable::detail::to<StringHandle>(v);
  size_t length = 0;
  const char* data = nullptr;
  STABLE_TORCH_ERROR_CODE_CHECK(torch_string_length(handle, &length));
  STABLE_TORCH_ERROR_CODE_CHECK(torch_string_c_str(handle, &data));
  std::string value(data, length);
  STABLE_TORCH_ERROR_CODE_CHECK(torch_delete_string(handle));
  return value;
}

std::vector<std::string> read_strings(StableIValue v) {
  auto list = torch::stable::detail::to<StableListHandle>(v);
  size_t size = 0;
  STABLE_TORCH_ERROR_CODE_CHECK(torch_list_size(list, &size));
  std::vector<std::string> values;
  values.reserve(size);
  // Each element is ours to free (as torch's list conversion takes them);
  // the list itself is freed after.
  for (size_t i = 0; i < size; ++i) {
    StableIValue element;
    STABLE_TORCH_ERROR_CODE_CHECK(torch_list_get_item(list, i, &element));
    values.push_back(read_string(element));
  }
  STABLE_TORCH_ERROR_CODE_CHECK(torch_delete_list(list));
  return values;
}

namespace box_detail {

void check_counts(uint64_t num_args, uint64_t num_outputs, size_t params, size_t returns) {
  CPLIB_CHECK(num_args == params && num_outputs == returns, "cplib: an op's schema has ", num_args,
              " arguments and ", num_outputs, " returns, its kernel ", params, " and ", returns,
              " (an internal error; please report it)");
}

}  // namespace box_detail
}  // namespace cplib
