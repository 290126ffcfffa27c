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
  for (const auto& p : cfg.kv_layout.positions)
    kv_sorted_.push_back(std::is_sorted(p.begin(), p.end()));
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
  // Only the rows a receiver reads travel (p2p and alltoall; the explicit
  // layouts of caches and pass-Q keep whole blocks).
  const bool compact = cfg.rotate != Rotate::allgather && !cfg.pass_q &&
                       !cfg.kv_layout.is_explicit();
  for (int64_t s = 0; s < steps(); ++s) {
    calls_.push_back(plan_pair(cfg.rank, source(s), /*any_only=*/false));
    recv_.push_back(rows_read(calls_.back(), kv_len(source(s)), compact && s > 0));
    send_.push_back(rows_read(s > 0 && sends(s) ? plan_pair(target(s), cfg.rank, false)
                                                : std::vector<Call>(),
                              kv_len(cfg.rank), compact && s > 0));
    if (recv_.back().ranges.empty()) continue;
    // Each call's key rows lie inside one received range: index them there.
    const std::vector<Range>& got = recv_.back().ranges;
    for (Call& c : calls_.back()) {
      int64_t at = 0;
      for (const Range& g : got) {
        if (c.k_local >= g.start && c.k_local < g.end()) {
          c.k_local = at + (c.k_local - g.start);
          break;
        }
        at += g.len;
      }
    }
  }
}

RingPlan::Rows RingPlan::rows_read(const std::vector<Call>& calls, int64_t len,
                                   bool compact) const {
  Rows rows;
  rows.count = len;
  if (!compact) return rows;
  std::vector<Range> read;
  for (const Call& c : calls) read.push_back({c.k_local, c.k_len});
  std::sort(read.begin(), read.end(),
            [](const Range& a, const Range& b) { return a.start < b.start; });
  for (const Range& g : read) {
    if (!rows.ranges.empty() && g.start <= rows.ranges.back().end()) {
      Range& last = rows.ranges.back();
      last.len = std::max(last.end(), g.end()) - last.start;
    } else {
      rows.ranges.push_back(g);
    }
  }
  rows.count = 0;
  for (const Range& g : rows.ranges) rows.count += g.len;
  if (rows.ranges.size() == 1 && rows.count == len) rows.ranges.clear();  // the whole block
  return rows;
}

int64_t RingPlan::source(int64_t s) const { return mod(cfg_.rank - offsets_[s], cfg_.size); }
int64_t RingPlan::target(int64_t s) const { return mod(cfg_.rank + offsets_[s], cfg_.size); }

bool RingPlan::needs(int64_t rank, int64_t offset) const {
  return needs_[offset * cfg_.size + rank] != 0;
}

std::vector<Call> RingPlan::plan_pair(int64_t rank, int64_t src, bool any_only) const {
  if (cfg_.q_layout.is_explicit()) return plan_explicit(rank, src, any_only);
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

std::pair<Tensor, Tensor> RingPlan::mask(const Call& c, const aten::Opts& opts) const {
  if (c.q_rank < 0) return cfg_.mask.build(c.q(), c.k(), opts);
  auto slice = [](const std::vector<int64_t>& p, int64_t start, int64_t len) {
    return std::vector<int64_t>(p.begin() + start, p.begin() + start + len);
  };
  return cfg_.mask.build_at(slice(cfg_.q_layout.positions[c.q_rank], c.q_local, c.q_len),
                            slice(cfg_.kv_layout.positions[c.k_rank], c.k_local, c.k_len), opts);
}

// Explicit positions: tiles of kTile q rows (in local order). Against sorted
// k/v positions a tile sees one contiguous run of keys, found by binary
// search, and within it the keys every query of the tile sees form a run
// that needs no mask (the cached prefix, under a causal mask); the rest gets
// an explicit mask read on the positions. Unsorted k/v: the whole block,
// masked. Classification works on the hulls [min, max] of the positions,
// which is exact for "empty" and "full" and conservative otherwise.
std::vector<Call> RingPlan::plan_explicit(int64_t rank, int64_t src, bool any_only) const {
  const Mask& mask = cfg_.mask;
  const std::vector<int64_t>& qp = cfg_.q_layout.positions[rank];
  const std::vector<int64_t>& kp = cfg_.kv_layout.positions[src];
  std::vector<Call> calls;
  const int64_t lq = static_cast<int64_t>(qp.size()), lk = static_cast<int64_t>(kp.size());
  if (lq == 0 || lk == 0) return calls;
  const bool sorted = kv_sorted_[src] != 0;
  auto hull = [](const std::vector<int64_t>& p, int64_t a, int64_t b) {
    const auto [lo, hi] = std::minmax_element(p.begin() + a, p.begin() + b);
    return Range{*lo, *hi - *lo + 1};
  };
  // Key rows [a, b) of the sorted block with positions in [lo, hi].
  auto rows_in = [&kp](int64_t lo, int64_t hi, int64_t a, int64_t b) {
    const int64_t x = std::lower_bound(kp.begin() + a, kp.begin() + b, lo) - kp.begin();
    const int64_t y = std::upper_bound(kp.begin() + a, kp.begin() + b, hi) - kp.begin();
    return std::pair<int64_t, int64_t>{x, std::max(x, y)};
  };
  auto emit = [&](int64_t q0, int64_t qn, Range qh, int64_t k0, int64_t k1) {
    if (k1 <= k0) return;
    Visibility v = mask.classify(qh, hull(kp, k0, k1));
    if (v == Visibility::empty) return;
    if (v == Visibility::causal) v = Visibility::partial;  // local orders may differ
    Call c;
    c.kind = v;
    c.q_local = q0;
    c.q_len = qn;
    c.k_local = k0;
    c.k_len = k1 - k0;
    c.q_rank = rank;
    c.k_rank = src;
    calls.push_back(c);
  };
  for (int64_t t = 0; t < lq; t += kTile) {
    const int64_t qn = std::min(kTile, lq - t);
    const Range qh = hull(qp, t, t + qn);
    if (!sorted) {
      emit(t, qn, qh, 0, lk);
    } else {
      const Range vis = mask.visible_keys(qh, {kp.front(), kp.back() - kp.front() + 1});
      if (vis.empty()) continue;
      const auto [a, b] = rows_in(vis.start, vis.end() - 1, 0, lk);
      // Keys every query of the tile sees (by the window; documents are
      // checked by classify): [qmax - left, qmin + right].
      const auto [fa, fb] = rows_in(qh.end() - 1 - mask.left, qh.start + mask.right, a, b);
      if (fa < fb) {
        emit(t, qn, qh, a, fa);
        emit(t, qn, qh, fa, fb);
        emit(t, qn, qh, fb, b);
      } else {
        emit(t, qn, qh, a, b);
      }
    }
    if (any_only && !calls.empty()) return calls;
  }
  return calls;
}

}  // namespace cplib::ring
