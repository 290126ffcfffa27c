// Halo exchange for tp_convolution: building the extended local input and
// returning halo gradients to their owners. Packing runs in the C core
// (csrc/core/halo.c, csrc/cuda/halo.cu).
#pragma once

#include <ATen/ATen.h>

#include "comm.h"
#include "tp_conv_plan.h"

namespace cplib {

// [zero pad | left halo] x [right halo | zero pad] along plan.dim, as a fresh
// contiguous tensor. Both sends and both receives are in flight together,
// overlapped with copying x into the middle.
at::Tensor extend_input(const PG& pg, const TpConvPlan& plan, const at::Tensor& x);

// grad of the extended input -> grad of x: the middle, plus the halo
// gradients the neighbours send back (they belong to this rank's borders).
at::Tensor return_halo_grads(const PG& pg, const TpConvPlan& plan, const at::Tensor& grad_ext);

}  // namespace cplib
