#pragma once

#include <tuple>

#include "common/stable.h"

#include "attention/block.h"
#include "ring/ring.h"
#include "ring/ring_plan.h"

// Internal to the extension (torch's stable types are hidden).
#pragma GCC visibility push(hidden)

namespace cplib::ring {

// (out in q's dtype, lse in the accumulator dtype), both fresh and contiguous;
// with `sinks` defined, both after the sinks joined the softmax (apply_sinks).
std::tuple<Tensor, Tensor> ring_forward(const Config& cfg, const Tensor& q, const Tensor& k,
                                        const Tensor& v, const Tensor& sinks = Tensor());

// The same with queries travelling (ring_pass="q"): each rank attends the
// visiting q rows to its own k/v and returns the partial (out, lse) to their
// owner, who merges them. Forward only.
std::tuple<Tensor, Tensor> ring_forward_pass_q(const Config& cfg, const Tensor& q, const Tensor& k,
                                               const Tensor& v);

// One call of the plan: the block attention of q rows against k/v rows,
// masked as the call says; rows that see no key come back as (0, -inf).
attention::BlockResult attend(const Config& cfg, const RingPlan& plan, const Call& c,
                              const Tensor& q, const Tensor& k, const Tensor& v);

// (dq, dk, dv) in the inputs' dtype, fresh and contiguous; out/lse are the forward's.
std::tuple<Tensor, Tensor, Tensor> ring_backward(const Config& cfg, const Tensor& grad_out,
                                                 const Tensor& q, const Tensor& k, const Tensor& v,
                                                 const Tensor& out, const Tensor& lse);

}  // namespace cplib::ring

#pragma GCC visibility pop
