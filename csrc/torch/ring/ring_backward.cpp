// Ring attention backward: the k/v blocks are fetched again, each call runs
// the block backward with the merged global (out, lse), dQ accumulates
// locally and each visiting block's dK/dV goes back to its owner. All
// accumulation is fp32 (fp64).
#include "common/aten.h"
#include "ring/ring_block.h"
#include "ring/ring_forward.h"
#include "ring/ring_heads.h"
#include "ring/ring_plan.h"
#include "ring/ring_rotate.h"

namespace cplib::ring {

std::tuple<Tensor, Tensor, Tensor> ring_backward(const Config& cfg, const Tensor& grad_out,
                                                 const Tensor& q, const Tensor& k,
                                                 const Tensor& v, const Tensor& out,
                                                 const Tensor& lse) {
  const int64_t Lq = q.size(2);
  const auto acc = acc_dtype(q);
  const aten::Opts acc_opts = aten::opts_of(q).dtype_(acc);
  Tensor dq;  // the first call over every row initialises it

  const RingPlan plan(cfg);
  BlockRing ring(cfg, plan, {aten::contiguous(k), aten::contiguous(v)});
  GradRing grads(cfg, plan, k, v, acc);
  HeadExpander expand_k(cfg.groups, k, cfg.kv_layout.max_local_len()),
      expand_v(cfg.groups, v, cfg.kv_layout.max_local_len());
  for (int64_t s = 0; s < plan.steps(); ++s) {
    const KV blk = ring.fetch(s);
    grads.settle();
    if (blk[0].defined()) {
      for (const Call& c : plan.calls(s)) {
        auto rows = [&c](const Tensor& t) { return aten::narrow(t, 2, c.q_local, c.q_len); };
        Tensor mask;
        if (c.kind == Visibility::partial) mask = plan.mask(c, aten::opts_of(q)).first;
        auto [gq, gk, gv] = block_backward(
            cfg, rows(grad_out), rows(q), expand_k(aten::narrow(blk[0], 2, c.k_local, c.k_len)),
            expand_v(aten::narrow(blk[1], 2, c.k_local, c.k_len)), rows(out), rows(lse),
            c.kind == Visibility::causal, mask);
        if (!dq.defined() && c.q_len == Lq) {
          // the kernel's gq is (B, L, H, D)-strided
          dq = aten::contiguous(aten::to(gq, acc));
        } else {
          if (!dq.defined()) dq = aten::zeros(aten::sizes_of(q), acc_opts);
          aten::add_(rows(dq), gq);
        }
        // Computing first lets the gradient's arrival overlap the block backward.
        grads.add(s, gk, gv, c.k_local, c.k_len);
      }
    }
    grads.pass(s);
  }
  ring.finish();
  KV dkv = grads.result();
  if (!dq.defined()) dq = aten::zeros(aten::sizes_of(q), acc_opts);
  const auto dt = q.scalar_type();
  return {aten::to(dq, dt), aten::to(dkv[0], dt), aten::to(dkv[1], dt)};
}

}  // namespace cplib::ring
