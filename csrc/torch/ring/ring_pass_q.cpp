// The pass-Q ring: queries travel and k/v stay. At step s (offset o) rank r
// sends its q to r - o, the owner of the block it attends at that offset,
// receives the q of r + o, attends it to its own k/v through the plan's
// calls, and returns the partial (out, lse) to r + o, which merges it. The
// plan is the pass-KV ring's (same pairs, same skipped blocks), read the
// other way round; a message is posted only when its pair has work.
// Rotation "allgather" has no meaning here and runs as "p2p".
#include <limits>

#include "merge/merge_op.h"
#include "ring/ring_forward.h"
#include "ring/ring_heads.h"
#include "ring/ring_rotate.h"

namespace cplib::ring {
namespace {

constexpr int kQTag = 0x70;
constexpr int kOutTag = 0x71;
constexpr int kLseTag = 0x72;


}  // namespace

std::tuple<at::Tensor, at::Tensor> ring_forward_pass_q(const Config& cfg, const at::Tensor& q,
                                                       const at::Tensor& k, const at::Tensor& v) {
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), Dv = v.size(3);
  const auto acc_opts = q.options().dtype(acc_dtype(q));
  const double ninf = -std::numeric_limits<double>::infinity();
  at::Tensor out = at::zeros({B, H, Lq, Dv}, acc_opts);
  at::Tensor lse = at::full({B, H, Lq}, ninf, acc_opts);
  const at::Tensor qc = q.contiguous();

  const RingPlan plan(cfg);
  // The local k/v never move: expand their heads once.
  HeadExpander expand_k(cfg.groups, k, k.size(2)), expand_v(cfg.groups, v, v.size(2));
  const at::Tensor ke = expand_k(k.contiguous()), ve = expand_v(v.contiguous());
  // The partial (out, lse) of `qx` (rows of rank `owner`) against our k/v.
  auto attend_local = [&](const at::Tensor& qx, int64_t owner, at::Tensor& o, at::Tensor& l) {
    for (const Call& c : plan.calls_between(owner, cfg.rank)) {
      BlockResult r = attend(cfg, plan, c, qx.narrow(2, c.q_local, c.q_len),
                             ke.narrow(2, c.k_local, c.k_len), ve.narrow(2, c.k_local, c.k_len));
      merge_partial(o, l, r.out, r.lse, c.q_local);
    }
  };
  attend_local(qc, cfg.rank, out, lse);

  const bool collective = cfg.rotate == Rotate::alltoall || python_group(cfg.pg);
  for (int64_t s = 1; s < plan.steps(); ++s) {
    // In pass-KV terms we attend the block of source(s) and target(s)
    // attends ours; here our q visits source(s) and target(s)'s q visits us.
    const bool send_q = plan.receives(s), recv_q = plan.sends(s);
    if (!send_q && !recv_q && !collective) continue;
    const int64_t owner_k = plan.source(s), visitor = plan.target(s);
    const int64_t lx = cfg.q_layout.local_len(visitor);
    std::vector<WorkPtr> works;
    at::Tensor qx = recv_q ? at::empty({B, H, lx, q.size(3)}, q.options()) : at::Tensor();
    exchange(cfg, send_q ? qc : at::Tensor(), owner_k, qx, visitor, kQTag, q.options(), works,
             works);
    wait_all(works);
    at::Tensor ox, lx_lse;
    if (recv_q) {
      ox = at::zeros({B, H, lx, Dv}, acc_opts);
      lx_lse = at::full({B, H, lx}, ninf, acc_opts);
      attend_local(qx, visitor, ox, lx_lse);
    }
    at::Tensor mine_o = send_q ? at::empty({B, H, Lq, Dv}, acc_opts) : at::Tensor();
    at::Tensor mine_l = send_q ? at::empty({B, H, Lq}, acc_opts) : at::Tensor();
    exchange(cfg, ox, visitor, mine_o, owner_k, kOutTag, acc_opts, works, works);
    exchange(cfg, lx_lse, visitor, mine_l, owner_k, kLseTag, acc_opts, works, works);
    wait_all(works);
    if (send_q) merge_partial(out, lse, mine_o, mine_l, 0);
  }
  if (out.scalar_type() != q.scalar_type()) out = out.to(q.scalar_type());
  return {out, lse};
}

}  // namespace cplib::ring
