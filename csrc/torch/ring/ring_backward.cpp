// Ring attention backward: the k/v blocks go round again, each step runs the
// block backward with the merged global (out, lse), dQ accumulates locally and
// the block's dK/dV accumulator travels with it, so after N steps every
// block's gradient is back on its owner. All accumulation is fp32 (fp64).
#include "ring/ring_block.h"
#include "ring/ring_forward.h"
#include "ring/ring_heads.h"
#include "ring/ring_rotate.h"

namespace cplib::ring {

std::tuple<at::Tensor, at::Tensor, at::Tensor> ring_backward(
    const Config& cfg, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse) {
  const int64_t Lq = q.size(2), Lk = k.size(2);
  const auto acc = acc_dtype(q);
  at::Tensor dq;  // step 0 (the local block, every row) initialises it

  BlockRing ring(cfg, {k.contiguous(), v.contiguous()});
  GradRing grads(cfg, k, v, acc);
  HeadExpander expand_k(cfg.groups, k), expand_v(cfg.groups, v);
  for (int64_t i = 0; i < cfg.size; ++i) {
    const KV blk = ring.fetch(i);
    const Step s = plan_step(cfg, i, Lq, Lk);
    if (!s.skip) {
      auto rows = [&s](const at::Tensor& t) { return t.narrow(2, s.q_start, s.q_len); };
      auto [gq, gk, gv] = block_backward(
          cfg, rows(grad_out), rows(q), expand_k(blk[0].narrow(2, s.kv_start, s.kv_len)),
          expand_v(blk[1].narrow(2, s.kv_start, s.kv_len)), rows(out), rows(lse), s.causal);
      if (i == 0) {
        dq = gq.to(acc).contiguous();  // the kernel's gq is (B, L, H, D)-strided
      } else {
        rows(dq).add_(gq);
      }
      // Computing first lets the accumulator's arrival overlap the block backward.
      grads.add(i, gk, gv, s.kv_start, s.kv_len);
    }
    grads.pass(i);
  }
  ring.finish();
  KV dkv = grads.result();
  const auto dt = q.scalar_type();
  return {dq.to(dt), dkv[0].to(dt), dkv[1].to(dt)};
}

}  // namespace cplib::ring
