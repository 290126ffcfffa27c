// The two ways tp_convolution computes a rank's output once the plan says an
// exchange is needed (see TpConvPlan::patched). Both send and receive the
// same messages, so ranks may use different ways in one call.
#pragma once

#include <array>
#include <optional>

#include "comm/collectives.h"
#include "common/stable.h"
#include "conv/conv_aten.h"
#include "conv/tp_conv_halo.h"
#include "conv/tp_conv_plan.h"

namespace cplib {

// Convolution of [left pad/halo | x | right halo/pad], built as one copy.
Tensor tp_conv_extended(const Group& g, const TpConvPlan& p, const Tensor& x, const Tensor& w,
                        const std::optional<Tensor>& b, int64_t groups);
ConvGrads tp_conv_extended_backward(const Group& g, const TpConvPlan& p, const Tensor& grad_out,
                                    const Tensor& x, const Tensor& w, int64_t groups,
                                    std::array<bool, 3> mask);

// Convolution of x itself (padding `left` along dim, overlapped with the
// exchange), with the border columns recomputed from [halo | edge] slabs.
Tensor tp_conv_patched(const Group& g, const TpConvPlan& p, const Tensor& x, const Tensor& w,
                       const std::optional<Tensor>& b, int64_t groups);
ConvGrads tp_conv_patched_backward(const Group& g, const TpConvPlan& p, const Tensor& grad_out,
                                   const Tensor& x, const Tensor& w, int64_t groups,
                                   std::array<bool, 3> mask);

// Adds the gradients the neighbours return for this rank's border columns.
void add_returned_halo_grads(const Group& g, const TpConvPlan& p, Tensor& grad_x,
                             const Slab& grad_halo_left, const Slab& grad_halo_right);

}  // namespace cplib
