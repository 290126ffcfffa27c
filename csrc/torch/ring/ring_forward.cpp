// Ring attention forward: each step attends the local q to the visiting k/v
// block through the plan's calls and merges each partial (out, lse) into
// fp32 (fp64) accumulators in place, over just the rows the call touched.
#include "ring/ring_forward.h"

#include <limits>

#include "attention/block.h"
#include "attention/heads.h"
#include "attention/sinks.h"
#include "common/aten.h"
#include "merge/merge_op.h"
#include "ring/ring_plan.h"
#include "ring/ring_rotate.h"

namespace cplib::ring {

attention::BlockResult attend(const Config& cfg, const RingPlan& plan, const Call& c,
                              const Tensor& q, const Tensor& k, const Tensor& v) {
  if (c.kind != Visibility::partial)
    return attention::block_forward(cfg, q, k, v, c.kind == Visibility::causal);
  auto [mask, no_key] = plan.mask(c, aten::opts_of(q));
  attention::BlockResult r = attention::block_forward(cfg, q, k, v, false, mask);
  // Rows that see no key here contribute nothing: the kernels report lse 0
  // (CPU) for them, the merge needs -inf.
  r.out = aten::masked_fill(r.out, aten::view(no_key, {-1, 1}), 0.0);
  r.lse = aten::masked_fill(r.lse, no_key, -std::numeric_limits<double>::infinity());
  return r;
}

std::tuple<Tensor, Tensor> ring_forward(const Config& cfg, const Tensor& q, const Tensor& k,
                                        const Tensor& v, const Tensor& sinks) {
  if (cfg.pass_q) {
    auto [out, lse] = ring_forward_pass_q(cfg, q, k, v);
    if (!sinks.defined()) return {out, lse};
    Tensor acc = aten::to(out, lse.scalar_type());
    lse = attention::apply_sinks(acc, lse, sinks);
    return {aten::to(acc, q.scalar_type()), lse};
  }
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2);
  const aten::Opts acc_opts = aten::opts_of(q).dtype_(attention::acc_dtype(q));
  Tensor out = aten::empty({B, H, Lq, v.size(3)}, acc_opts);
  Tensor lse = aten::empty({B, H, Lq}, acc_opts);
  bool written = false;

  const RingPlan plan(cfg);
  BlockRing ring(cfg, plan, k, v);
  attention::HeadExpander expand_k(cfg.groups, k, cfg.kv_layout.max_local_len()),
      expand_v(cfg.groups, v, cfg.kv_layout.max_local_len());
  for (int64_t s = 0; s < plan.steps(); ++s) {
    const KV blk = ring.fetch(s);
    if (!blk[0].defined()) continue;
    for (const Call& c : plan.calls(s)) {
      attention::BlockResult r = attend(cfg, plan, c, aten::rows(q, 2, c.q_local, c.q_len),
                                        expand_k(aten::rows(blk[0], 2, c.k_local, c.k_len)),
                                        expand_v(aten::rows(blk[1], 2, c.k_local, c.k_len)));
      if (!written && c.q_len == Lq) {  // a call over every row initialises the accumulators
        aten::copy_(out, r.out);
        aten::copy_(lse, r.lse);
      } else {
        if (!written) {
          aten::zero_(out);
          aten::fill_(lse, -std::numeric_limits<double>::infinity());
        }
        merge_partial(out, lse, r.out, r.lse, c.q_local);
      }
      written = true;
    }
  }
  ring.finish();
  // Once per row, after the last merge: a sink merged per block would count
  // once per block.
  if (sinks.defined()) lse = attention::apply_sinks(out, lse, sinks);
  if (out.scalar_type() != q.scalar_type()) out = aten::to(out, q.scalar_type());
  return {out, lse};
}

}  // namespace cplib::ring
