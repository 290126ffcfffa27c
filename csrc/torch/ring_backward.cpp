// Ring attention backward: the k/v blocks go round again, each step runs the
// block backward with the merged global (out, lse), dQ accumulates locally and
// the block's dK/dV accumulator travels with it, so after N steps every
// block's gradient is back on its owner. All accumulation is fp32 (fp64).
#include "ring_block.h"
#include "ring_forward.h"
#include "ring_heads.h"
#include "ring_rotate.h"

namespace cplib::ring {

std::tuple<at::Tensor, at::Tensor, at::Tensor> ring_backward(
    const Config& cfg, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse) {
  const int64_t Lq = q.size(2), Lk = k.size(2);
  const auto acc_opts = q.options().dtype(acc_dtype(q));
  at::Tensor dq;  // step 0 (the local block, every row) initialises it

  BlockRing ring(cfg, pack_kv(k, v));
  GradRing grads(cfg, k.numel() + v.numel(), acc_opts);
  HeadExpander expand_k(cfg.groups, k), expand_v(cfg.groups, v);
  for (int64_t i = 0; i < cfg.size; ++i) {
    at::Tensor blk = ring.fetch(i);
    const Step s = plan_step(cfg, i, Lq, Lk);
    at::Tensor gk, gv;
    if (!s.skip) {
      auto [kb, vb] = unpack_kv(blk, k.sizes(), v.sizes());
      auto rows = [&s](const at::Tensor& t) { return t.narrow(2, s.q_start, s.q_len); };
      at::Tensor gq;
      std::tie(gq, gk, gv) = block_backward(
          cfg, rows(grad_out), rows(q), expand_k(kb.narrow(2, s.kv_start, s.kv_len)),
          expand_v(vb.narrow(2, s.kv_start, s.kv_len)), rows(out), rows(lse), s.causal);
      if (i == 0) {
        dq = gq.to(acc_opts.dtype()).contiguous();  // the kernel's gq is (B, L, H, D)-strided
      } else {
        rows(dq).add_(gq);
      }
    }
    // Computing first lets the accumulator's arrival overlap the block backward.
    at::Tensor acc = grads.at(i);
    if (!s.skip) {
      auto [ak, av] = unpack_kv(acc, k.sizes(), v.sizes());
      add_reduced_heads(ak.narrow(2, s.kv_start, s.kv_len), gk, cfg.groups);
      add_reduced_heads(av.narrow(2, s.kv_start, s.kv_len), gv, cfg.groups);
    }
    grads.pass(i);
  }
  ring.finish();
  auto [dk, dv] = unpack_kv(grads.result(), k.sizes(), v.sizes());
  const auto dt = q.scalar_type();
  // Fresh tensors each: dk and dv must not share the ring's buffer.
  return {dq.scalar_type() == dt ? dq : dq.to(dt), dk.to(dt, false, /*copy=*/true),
          dv.to(dt, false, /*copy=*/true)};
}

}  // namespace cplib::ring
