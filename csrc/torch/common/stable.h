// What every op file on LibTorch's stable ABI includes: torch's stable tensor,
// library and op headers (header-only, so one binary runs on every torch from
// TORCH_TARGET_VERSION on), cplib's error classes and the dispatcher call.
#pragma once

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include "common/dispatch.h"
#include "common/errors.h"

namespace cplib {

using Tensor = torch::stable::Tensor;
using Device = torch::stable::Device;
using torch::headeronly::DeviceType;
using torch::headeronly::ScalarType;

}  // namespace cplib
