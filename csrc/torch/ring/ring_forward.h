#pragma once

#include <tuple>

#include <ATen/ATen.h>

#include "ring/ring.h"
#include "ring/ring_block.h"
#include "ring/ring_plan.h"

namespace cplib::ring {

// (out in q's dtype, lse in the accumulator dtype), both fresh and contiguous;
// with `sinks` defined, both after the sinks joined the softmax (apply_sinks).
std::tuple<at::Tensor, at::Tensor> ring_forward(const Config& cfg, const at::Tensor& q,
                                                const at::Tensor& k, const at::Tensor& v,
                                                const at::Tensor& sinks = {});

// The same with queries travelling (ring_pass="q"): each rank attends the
// visiting q rows to its own k/v and returns the partial (out, lse) to their
// owner, who merges them. Forward only.
std::tuple<at::Tensor, at::Tensor> ring_forward_pass_q(const Config& cfg, const at::Tensor& q,
                                                       const at::Tensor& k, const at::Tensor& v);

// One call of the plan: the block attention of q rows against k/v rows,
// masked as the call says; rows that see no key come back as (0, -inf).
BlockResult attend(const Config& cfg, const RingPlan& plan, const Call& c, const at::Tensor& q,
                   const at::Tensor& k, const at::Tensor& v);

// (dq, dk, dv) in the inputs' dtype, fresh and contiguous; out/lse are the forward's.
std::tuple<at::Tensor, at::Tensor, at::Tensor> ring_backward(
    const Config& cfg, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse);

}  // namespace cplib::ring
