// The pass-Q ring: queries travel and k/v stay. At step s (offset o) rank r
// sends its q to r - o, the owner of the block it attends at that offset,
// receives the q of r + o, attends it to its own k/v through the plan's
// calls, and returns the partial (out, lse) to r + o, which merges it. The
// plan is the pass-KV ring's (same pairs, same skipped blocks), read the
// other way round; a message is non-empty only when its pair has work.
// Rotation "allgather" has no meaning here and runs as "p2p".
#include <limits>

#include "attention/heads.h"
#include "common/aten.h"
#include "merge/merge_op.h"
#include "ring/ring_forward.h"
#include "ring/ring_rotate.h"

namespace cplib::ring {

std::tuple<Tensor, Tensor> ring_forward_pass_q(const Config& cfg, const Tensor& q, const Tensor& k,
                                               const Tensor& v) {
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), Dv = v.size(3);
  const aten::Opts acc_opts = aten::opts_of(q).dtype_(attention::acc_dtype(q));
  const double ninf = -std::numeric_limits<double>::infinity();
  Tensor out = aten::zeros({B, H, Lq, Dv}, acc_opts);
  Tensor lse = aten::full({B, H, Lq}, ninf, acc_opts);
  const Tensor qc = aten::contiguous(q);

  const RingPlan plan(cfg);
  // The local k/v never move: expand their heads once.
  attention::HeadExpander expand_k(cfg.groups, k, k.size(2)), expand_v(cfg.groups, v, v.size(2));
  const Tensor ke = expand_k(aten::contiguous(k)), ve = expand_v(aten::contiguous(v));
  // The partial (out, lse) of `qx` (rows of rank `owner`) against our k/v.
  auto attend_local = [&](const Tensor& qx, int64_t owner, Tensor& o, Tensor& l) {
    for (const Call& c : plan.calls_between(owner, cfg.rank)) {
      attention::BlockResult r = attend(cfg, plan, c, aten::narrow(qx, 2, c.q_local, c.q_len),
                                        aten::narrow(ke, 2, c.k_local, c.k_len),
                                        aten::narrow(ve, 2, c.k_local, c.k_len));
      merge_partial(o, l, r.out, r.lse, c.q_local);
    }
  };
  attend_local(qc, cfg.rank, out, lse);

  for (int64_t s = 1; s < plan.steps(); ++s) {
    // In pass-KV terms we attend the block of source(s) and target(s)
    // attends ours; here our q visits source(s) and target(s)'s q visits us.
    const bool send_q = plan.receives(s), recv_q = plan.sends(s);
    const int64_t owner_k = plan.source(s), visitor = plan.target(s);
    const int64_t lx = cfg.q_layout.local_len(visitor);
    std::vector<Tensor> pending;
    const Tensor qx_flat = exchange(cfg, send_q ? qc : Tensor(), owner_k,
                                    recv_q ? B * H * lx * q.size(3) : 0, visitor, aten::opts_of(q),
                                    pending);
    wait_all(pending);
    Tensor ox, lx_lse;
    if (recv_q) {
      ox = aten::zeros({B, H, lx, Dv}, acc_opts);
      lx_lse = aten::full({B, H, lx}, ninf, acc_opts);
      attend_local(aten::view(qx_flat, {B, H, lx, q.size(3)}), visitor, ox, lx_lse);
    }
    const Tensor mine_o = exchange(cfg, ox, visitor, send_q ? B * H * Lq * Dv : 0, owner_k,
                                   acc_opts, pending);
    const Tensor mine_l = exchange(cfg, lx_lse, visitor, send_q ? B * H * Lq : 0, owner_k, acc_opts,
                                   pending);
    wait_all(pending);
    if (send_q) {
      Tensor o = aten::view(mine_o, {B, H, Lq, Dv}), l = aten::view(mine_l, {B, H, Lq});
      merge_partial(out, lse, o, l, 0);
    }
  }
  if (out.scalar_type() != q.scalar_type()) out = aten::to(out, q.scalar_type());
  return {out, lse};
}

}  // namespace cplib::ring
