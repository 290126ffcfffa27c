// Ring attention backward: the k/v blocks are fetched again, each call runs
// the block backward with the merged global (out, lse), dQ accumulates
// (summed once per row at the end: merge/partial_sum.h) and each visiting
// block's dK/dV goes back to its owner. All accumulation is fp32 (fp64).
#include <limits>

#include "attention/block.h"
#include "attention/heads.h"
#include "common/aten.h"
#include "merge/partial_sum.h"
#include "ring/ring_forward.h"
#include "ring/ring_plan.h"
#include "ring/ring_rotate.h"

namespace cplib::ring {

std::tuple<Tensor, Tensor, Tensor> ring_backward(const Config& cfg, const Tensor& grad_out,
                                                 const Tensor& q, const Tensor& k, const Tensor& v,
                                                 const Tensor& out, const Tensor& lse) {
  const auto acc = attention::acc_dtype(q);
  const aten::Opts acc_opts = aten::opts_of(q).dtype_(acc);
  // dq's partial gradients are held as the kernels gave them and summed once
  // per row at the end, in the accumulator dtype (partial_sum.h): up to two
  // whole dq of fp16/bf16 held, the float32 accumulator's bytes.
  const std::vector<int64_t> q_sizes = aten::sizes_of(q);
  PartialSum dq_sum(q_sizes, acc_opts, /*weighted=*/false, held_budget(q, q_sizes, 1));
  const int64_t row_bytes = q.size(0) * q.size(1) * q.size(3) * q.element_size();

  const RingPlan plan(cfg);
  BlockRing ring(cfg, plan, k, v);
  GradRing grads(cfg, plan, k, v, acc);
  attention::HeadExpander expand_k(cfg.groups, k, cfg.kv_layout.max_local_len()),
      expand_v(cfg.groups, v, cfg.kv_layout.max_local_len());
  // A row that sees no key at all has lse -inf, and the block backward's
  // exp(score - lse) would be NaN there; +inf gives probability 0 to every
  // key (dq 0, nothing added to dk/dv). Only masked calls hold such rows.
  Tensor masked_lse;
  auto lse_of = [&](const Call& c) -> const Tensor& {
    if (c.kind != Visibility::partial) return lse;
    if (!masked_lse.defined()) {
      const double inf = std::numeric_limits<double>::infinity();
      masked_lse = aten::masked_fill(lse, aten::eq(lse, aten::full({}, -inf, aten::opts_of(lse))),
                                     inf);
    }
    return masked_lse;
  };
  for (int64_t s = 0; s < plan.steps(); ++s) {
    const KV blk = ring.fetch(s);
    grads.settle();
    if (blk[0].defined()) {
      const std::vector<Call> calls = plan.calls(s);
      for (const Call& c : calls) {
        auto rows = [&c](const Tensor& t) { return aten::rows(t, 2, c.q_local, c.q_len); };
        Tensor mask;
        if (c.kind == Visibility::partial) mask = plan.mask(c, aten::opts_of(q)).first;
        dq_sum.reserve(c.q_len * row_bytes);
        auto [gq, gk, gv] = attention::block_backward(
            cfg, rows(grad_out), rows(q), expand_k(aten::rows(blk[0], 2, c.k_local, c.k_len)),
            expand_v(aten::rows(blk[1], 2, c.k_local, c.k_len)), rows(out), rows(lse_of(c)),
            c.kind == Visibility::causal, mask);
        dq_sum.add(gq, Tensor(), c.q_local);
        // One call: the block is spent, and its buffer can carry its gradient.
        if (calls.size() == 1) grads.reuse(s, ring.arrived(s));
        // Computing first lets the gradient's arrival overlap the block backward.
        grads.add(s, gk, gv, c.k_local, c.k_len);
      }
    }
    grads.pass(s);
  }
  ring.finish();
  KV dkv = grads.result();
  const auto dt = q.scalar_type();
  Tensor dq = dq_sum.finish(dt).first;
  if (dt == acc) return {dq, dkv[0], dkv[1]};
  return {dq, aten::to(dkv[0], dt), aten::to(dkv[1], dt)};
}

}  // namespace cplib::ring
