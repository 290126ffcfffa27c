// How sizes, dtypes and devices read in cplib's error messages.
#pragma once

#include <ostream>
#include <string>

#include <torch/csrc/stable/device.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/HeaderOnlyArrayRef.h>

namespace cplib {

// "[2, 4, 128, 16]"
std::string format_sizes(torch::headeronly::IntHeaderOnlyArrayRef sizes);
// "cpu", "cuda:1"
std::string format_device(const torch::stable::Device& device);
// "cpu", "cuda": a device type alone, as torch writes it.
std::string format_device_type(torch::headeronly::DeviceType type);

}  // namespace cplib

// In the namespace torch declares the array type in, for argument lookup.
namespace c10 {
inline std::ostream& operator<<(std::ostream& os, HeaderOnlyArrayRef<int64_t> sizes) {
  return os << cplib::format_sizes(sizes);
}
}  // namespace c10

namespace torch::stable {
inline std::ostream& operator<<(std::ostream& os, const Device& device) {
  return os << cplib::format_device(device);
}
}  // namespace torch::stable
