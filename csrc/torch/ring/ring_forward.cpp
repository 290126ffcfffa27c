// Ring attention forward: each step attends the local q to the visiting k/v
// block and merges the partial (out, lse) into fp32 (fp64) accumulators in
// place, over just the rows the step touched.
#include "ring/ring_forward.h"

#include "merge/merge_op.h"
#include "ring/ring_block.h"
#include "ring/ring_heads.h"
#include "ring/ring_rotate.h"

namespace cplib::ring {

std::tuple<at::Tensor, at::Tensor> ring_forward(const Config& cfg, const at::Tensor& q,
                                                const at::Tensor& k, const at::Tensor& v) {
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), Lk = k.size(2);
  const auto acc_opts = q.options().dtype(acc_dtype(q));
  at::Tensor out = at::empty({B, H, Lq, v.size(3)}, acc_opts);
  at::Tensor lse = at::empty({B, H, Lq}, acc_opts);

  BlockRing ring(cfg, {k.contiguous(), v.contiguous()});
  HeadExpander expand_k(cfg.groups, k), expand_v(cfg.groups, v);
  for (int64_t i = 0; i < cfg.size; ++i) {
    const KV blk = ring.fetch(i);
    const Step s = plan_step(cfg, i, Lq, Lk);
    if (s.skip) continue;
    BlockResult r = block_forward(cfg, q.narrow(2, s.q_start, s.q_len),
                                  expand_k(blk[0].narrow(2, s.kv_start, s.kv_len)),
                                  expand_v(blk[1].narrow(2, s.kv_start, s.kv_len)), s.causal);
    if (i == 0) {  // the local block covers every row: it initialises the accumulators
      out.copy_(r.out);
      lse.copy_(r.lse);
    } else {
      merge_partial(out, lse, r.out, r.lse, s.q_start);
    }
  }
  ring.finish();
  if (out.scalar_type() != q.scalar_type()) out = out.to(q.scalar_type());
  return {out, lse};
}

}  // namespace cplib::ring
