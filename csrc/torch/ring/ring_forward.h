#pragma once

#include <tuple>

#include <ATen/ATen.h>

#include "ring/ring.h"

namespace cplib::ring {

// (out in q's dtype, lse in the accumulator dtype), both fresh and contiguous;
// with `sinks` defined, both after the sinks joined the softmax (apply_sinks).
std::tuple<at::Tensor, at::Tensor> ring_forward(const Config& cfg, const at::Tensor& q,
                                                const at::Tensor& k, const at::Tensor& v,
                                                const at::Tensor& sinks = {});

// (dq, dk, dv) in the inputs' dtype, fresh and contiguous; out/lse are the forward's.
std::tuple<at::Tensor, at::Tensor, at::Tensor> ring_backward(
    const Config& cfg, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse);

}  // namespace cplib::ring
