#include "common/format.h"

#include <sstream>

namespace cplib {

std::string format_sizes(torch::headeronly::IntHeaderOnlyArrayRef sizes) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < sizes.size(); ++i) os << (i ? ", " : "") << sizes[i];
  os << "]";
  return os.str();
}

std::string format_device_type(torch::headeronly::DeviceType type) {
  switch (type) {
    case torch::headeronly::DeviceType::CPU: return "cpu";
    case torch::headeronly::DeviceType::CUDA: return "cuda";
    case torch::headeronly::DeviceType::Meta: return "meta";
    case torch::headeronly::DeviceType::PrivateUse1: return "privateuseone";
    default: return "device type " + std::to_string(static_cast<int>(type));
  }
}

std::string format_device(const torch::stable::Device& device) {
  std::string s = format_device_type(device.type());
  if (device.has_index()) s += ":" + std::to_string(static_cast<int>(device.index()));
  return s;
}

}  // namespace cplib
