// Ring attention forward: each step attends the local q to the visiting k/v
// block through the plan's calls and merges each partial (out, lse) into
// fp32 (fp64) accumulators in place, over just the rows the call touched.
#include "ring/ring_forward.h"

#include <limits>

#include "merge/merge_op.h"
#include "ring/ring_block.h"
#include "ring/ring_heads.h"
#include "ring/ring_plan.h"
#include "ring/ring_rotate.h"

namespace cplib::ring {

BlockResult attend(const Config& cfg, const RingPlan& plan, const Call& c, const at::Tensor& q,
                   const at::Tensor& k, const at::Tensor& v) {
  if (c.kind != Visibility::partial) return block_forward(cfg, q, k, v, c.kind == Visibility::causal);
  auto [mask, no_key] = plan.mask(c, q.options());
  BlockResult r = block_forward(cfg, q, k, v, false, mask);
  // Rows that see no key here contribute nothing: the kernels report lse 0
  // (CPU) for them, the merge needs -inf.
  r.out = r.out.masked_fill(no_key.view({-1, 1}), 0);
  r.lse = r.lse.masked_fill(no_key, -std::numeric_limits<double>::infinity());
  return r;
}

std::tuple<at::Tensor, at::Tensor> ring_forward(const Config& cfg, const at::Tensor& q,
                                                const at::Tensor& k, const at::Tensor& v,
                                                const at::Tensor& sinks) {
  if (cfg.pass_q) {
    auto [out, lse] = ring_forward_pass_q(cfg, q, k, v);
    if (!sinks.defined()) return {out, lse};
    at::Tensor acc = out.to(lse.scalar_type());
    lse = apply_sinks(acc, lse, sinks);
    return {acc.to(q.scalar_type()), lse};
  }
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2);
  const auto acc_opts = q.options().dtype(acc_dtype(q));
  at::Tensor out = at::empty({B, H, Lq, v.size(3)}, acc_opts);
  at::Tensor lse = at::empty({B, H, Lq}, acc_opts);
  bool written = false;

  const RingPlan plan(cfg);
  BlockRing ring(cfg, plan, {k.contiguous(), v.contiguous()});
  HeadExpander expand_k(cfg.groups, k, cfg.kv_layout.max_local_len()),
      expand_v(cfg.groups, v, cfg.kv_layout.max_local_len());
  for (int64_t s = 0; s < plan.steps(); ++s) {
    const KV blk = ring.fetch(s);
    if (!blk[0].defined()) continue;
    for (const Call& c : plan.calls(s)) {
      BlockResult r = attend(cfg, plan, c, q.narrow(2, c.q_local, c.q_len),
                             expand_k(blk[0].narrow(2, c.k_local, c.k_len)),
                             expand_v(blk[1].narrow(2, c.k_local, c.k_len)));
      if (!written && c.q_len == Lq) {  // a call over every row initialises the accumulators
        out.copy_(r.out);
        lse.copy_(r.lse);
      } else {
        if (!written) {
          out.zero_();
          lse.fill_(-std::numeric_limits<double>::infinity());
        }
        merge_partial(out, lse, r.out, r.lse, c.q_local);
      }
      written = true;
    }
  }
  ring.finish();
  // Once per row, after the last merge: a sink merged per block would count
  // once per block.
  if (sinks.defined()) lse = apply_sinks(out, lse, sinks);
  if (out.scalar_type() != q.scalar_type()) out = out.to(q.scalar_type());
  return {out, lse};
}

}  // namespace cplib::ring
