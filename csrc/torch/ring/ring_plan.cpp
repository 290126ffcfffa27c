// The per-step schedule of the ring: which rows of q meet which rows of the
// visiting k/v block, under the mask, in global positions.
#include "ring/ring_plan.h"

#include <algorithm>

namespace cplib::ring {
namespace {

// Rows per call when a rectangle needs an explicit mask: each tile of q rows
// attends only the keys it can see, so windows and documents cost what they
// show, not the whole block.
constexpr int64_t kTile = 256;

int64_t mod(int64_t a, int64_t n) { return ((a % n) + n) % n; }

}  // namespace

RingPlan::RingPlan(const Config& cfg) : cfg_(cfg) {
  const int64_t n = cfg.size;
  needs_.assign(n * n, 0);
  offsets_.push_back(0);
  for (int64_t d = 0; d < n; ++d) {
    bool any = false;
    for (int64_t r = 0; r < n; ++r) {
      needs_[d * n + r] = !plan_pair(r, mod(r - d, n), /*any_only=*/true).empty();
      any = any || needs_[d * n + r];
    }
    if (d > 0 && any) offsets_.push_back(d);
  }
}

int64_t RingPlan::source(int64_t s) const { return mod(cfg_.rank - offsets_[s], cfg_.size); }
int64_t RingPlan::target(int64_t s) const { return mod(cfg_.rank + offsets_[s], cfg_.size); }

bool RingPlan::needs(int64_t rank, int64_t offset) const {
  return needs_[offset * cfg_.size + rank] != 0;
}

std::vector<Call> RingPlan::calls(int64_t s) const {
  return plan_pair(cfg_.rank, source(s), /*any_only=*/false);
}

std::vector<Call> RingPlan::plan_pair(int64_t rank, int64_t src, bool any_only) const {
  const Mask& mask = cfg_.mask;
  const std::vector<Piece> qp = cfg_.q_layout.pieces(rank), kp = cfg_.kv_layout.pieces(src);
  const size_t nq = qp.size(), nk = kp.size();
  std::vector<Visibility> cls(nq * nk);
  bool all_full = true, any = false;
  for (size_t a = 0; a < nq; ++a)
    for (size_t b = 0; b < nk; ++b) {
      const Visibility v = mask.classify(qp[a].global, kp[b].global);
      cls[a * nk + b] = v;
      any = any || v != Visibility::empty;
      all_full = all_full && (v == Visibility::full || v == Visibility::empty);
    }
  std::vector<Call> calls;
  if (!any) return calls;
  auto whole = [](const std::vector<Piece>& p, size_t first, size_t last) {
    return std::pair<int64_t, int64_t>{p[first].local,
                                       p[last].local + p[last].global.len - p[first].local};
  };
  auto push = [&calls](Visibility kind, std::pair<int64_t, int64_t> rows,
                       std::pair<int64_t, int64_t> cols) {
    Call c;
    c.kind = kind;
    c.q_local = rows.first;
    c.q_len = rows.second;
    c.k_local = cols.first;
    c.k_len = cols.second;
    calls.push_back(c);
  };
  if (any_only) {
    calls.emplace_back();
    return calls;
  }
  // One full call when the visible cells form a product of pieces (the
  // dense ring, and the load-balanced causal ring's off-diagonal steps).
  if (all_full) {
    size_t r0 = nq, r1 = 0, c0 = nk, c1 = 0;
    for (size_t a = 0; a < nq; ++a)
      for (size_t b = 0; b < nk; ++b)
        if (cls[a * nk + b] != Visibility::empty) {
          r0 = std::min(r0, a), r1 = std::max(r1, a), c0 = std::min(c0, b), c1 = std::max(c1, b);
        }
    bool product = true;
    for (size_t a = r0; a <= r1; ++a)
      for (size_t b = c0; b <= c1; ++b) product = product && cls[a * nk + b] == Visibility::full;
    if (product) {
      push(Visibility::full, whole(qp, r0, r1), whole(kp, c0, c1));
      return calls;
    }
  }
  // One causal call over the local block when, in local order, it is exactly
  // the causal diagonal (head-tail: A precedes B, so [A|B]x[A|B] is causal).
  if (nq == nk && rank == src && cfg_.q_layout.seq_len == cfg_.kv_layout.seq_len) {
    bool local_causal = true;
    for (size_t a = 0; a < nq; ++a)
      for (size_t b = 0; b < nk; ++b) {
        const Visibility want =
            a == b ? Visibility::causal : (a < b ? Visibility::empty : Visibility::full);
        local_causal = local_causal && cls[a * nk + b] == want;
      }
    if (local_causal) {
      push(Visibility::causal, whole(qp, 0, nq - 1), whole(kp, 0, nk - 1));
      return calls;
    }
  }
  for (size_t a = 0; a < nq; ++a)
    for (size_t b = 0; b < nk; ++b) {
      const Visibility v = cls[a * nk + b];
      const Piece &q = qp[a], &k = kp[b];
      if (v == Visibility::full || v == Visibility::causal) {
        push(v, {q.local, q.global.len}, {k.local, k.global.len});
        continue;
      }
      if (v == Visibility::empty) continue;
      for (int64_t t = 0; t < q.global.len; t += kTile) {
        const Range qt{q.global.start + t, std::min(kTile, q.global.len - t)};
        const Range kt = mask.visible_keys(qt, k.global);
        const Visibility vt = mask.classify(qt, kt);
        if (vt == Visibility::empty) continue;
        Call c;
        c.kind = vt;
        c.q_local = q.local + t;
        c.q_len = qt.len;
        c.k_local = k.local + (kt.start - k.global.start);
        c.k_len = kt.len;
        c.q_global = qt.start;
        c.k_global = kt.start;
        calls.push_back(c);
      }
    }
  return calls;
}

}  // namespace cplib::ring
