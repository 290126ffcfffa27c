// The two ways tp_convolution computes a rank's output once the plan says an
// exchange is needed (see TpConvPlan::patched). Both send and receive the
// same messages, so ranks may use different ways in one call.
#pragma once

#include <array>
#include <tuple>

#include <ATen/ATen.h>

#include "comm/comm.h"
#include "conv/tp_conv_plan.h"

namespace cplib {

using ConvGrads = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// Convolution of [left pad/halo | x | right halo/pad], built as one copy.
at::Tensor tp_conv_extended(const PG& pg, const TpConvPlan& p, const at::Tensor& x,
                            const at::Tensor& w, const c10::optional<at::Tensor>& b,
                            int64_t groups);
ConvGrads tp_conv_extended_backward(const PG& pg, const TpConvPlan& p, const at::Tensor& grad_out,
                                    const at::Tensor& x, const at::Tensor& w, int64_t groups,
                                    std::array<bool, 3> mask);

// Convolution of x itself (padding `left` along dim, overlapped with the
// exchange), with the border columns recomputed from [halo | edge] slabs.
at::Tensor tp_conv_patched(const PG& pg, const TpConvPlan& p, const at::Tensor& x,
                           const at::Tensor& w, const c10::optional<at::Tensor>& b,
                           int64_t groups);
ConvGrads tp_conv_patched_backward(const PG& pg, const TpConvPlan& p, const at::Tensor& grad_out,
                                   const at::Tensor& x, const at::Tensor& w, int64_t groups,
                                   std::array<bool, 3> mask);

// Adds the gradients the neighbours return for this rank's border columns.
void add_returned_halo_grads(const PG& pg, const TpConvPlan& p, at::Tensor& grad_x,
                             const at::Tensor& grad_halo_left, const at::Tensor& grad_halo_right);

inline std::vector<int64_t> zeros_like_params(const TpConvPlan& p) {
  return std::vector<int64_t>(p.stride.size(), 0);
}

}  // namespace cplib
