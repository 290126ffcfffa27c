// Ring attention backward: the k/v blocks are fetched again, each call runs
// the block backward with the merged global (out, lse), dQ accumulates
// locally and each visiting block's dK/dV goes back to its owner. All
// accumulation is fp32 (fp64).
#include "ring/ring_block.h"
#include "ring/ring_forward.h"
#include "ring/ring_heads.h"
#include "ring/ring_plan.h"
#include "ring/ring_rotate.h"

namespace cplib::ring {

std::tuple<at::Tensor, at::Tensor, at::Tensor> ring_backward(
    const Config& cfg, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse) {
  const int64_t Lq = q.size(2);
  const auto acc = acc_dtype(q);
  at::Tensor dq;  // the first call over every row initialises it

  const RingPlan plan(cfg);
  BlockRing ring(cfg, plan, {k.contiguous(), v.contiguous()});
  GradRing grads(cfg, plan, k, v, acc);
  HeadExpander expand_k(cfg.groups, k, cfg.kv_layout.max_local_len()),
      expand_v(cfg.groups, v, cfg.kv_layout.max_local_len());
  for (int64_t s = 0; s < plan.steps(); ++s) {
    const KV blk = ring.fetch(s);
    grads.settle();
    if (blk[0].defined()) {
      for (const Call& c : plan.calls(s)) {
        auto rows = [&c](const at::Tensor& t) { return t.narrow(2, c.q_local, c.q_len); };
        at::Tensor mask;
        if (c.kind == Visibility::partial) mask = plan.mask(c, q.options()).first;
        auto [gq, gk, gv] = block_backward(
            cfg, rows(grad_out), rows(q), expand_k(blk[0].narrow(2, c.k_local, c.k_len)),
            expand_v(blk[1].narrow(2, c.k_local, c.k_len)), rows(out), rows(lse),
            c.kind == Visibility::causal, mask);
        if (!dq.defined() && c.q_len == Lq) {
          dq = gq.to(acc).contiguous();  // the kernel's gq is (B, L, H, D)-strided
        } else {
          if (!dq.defined()) dq = at::zeros(q.sizes(), q.options().dtype(acc));
          rows(dq).add_(gq);
        }
        // Computing first lets the gradient's arrival overlap the block backward.
        grads.add(s, gk, gv, c.k_local, c.k_len);
      }
    }
    grads.pass(s);
  }
  ring.finish();
  KV dkv = grads.result();
  if (!dq.defined()) dq = at::zeros(q.sizes(), q.options().dtype(acc));
  const auto dt = q.scalar_type();
  return {dq.to(dt), dkv[0].to(dt), dkv[1].to(dt)};
}

}  // namespace cplib::ring
