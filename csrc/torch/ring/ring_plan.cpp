// The per-step schedule of the ring: which rows of q meet which rows of the
// visiting k/v block, under the mask, in global positions.
#include "ring/ring_plan.h"

#include <algorithm>

#include "ring/ring_placement.h"

namespace cplib::ring {
namespace {

// Rows per call when a rectangle needs an explicit mask: each tile of q rows
// attends only the keys it can see, so windows and documents cost what they
// show, not the whole block.
constexpr int64_t kTile = 256;

int64_t mod(int64_t a, int64_t n) { return ((a % n) + n) % n; }

// The values a plan depends on, or empty when it is not cached (explicit
// positions: a cache's positions change every call).
std::vector<int64_t> plan_key(const Config& c) {
  if (c.q_layout.is_explicit() || c.kv_layout.is_explicit()) return {};
  std::vector<int64_t> key{c.rank,      c.size,        static_cast<int64_t>(c.rotate),
                           c.pass_q,    c.mask.causal, c.mask.seq_len,
                           c.mask.left, c.mask.right};
  auto add = [&key](const std::vector<int64_t>& v) {
    key.push_back(static_cast<int64_t>(v.size()));
    key.insert(key.end(), v.begin(), v.end());
  };
  add(c.mask.bounds);
  for (const Layout* l : {&c.q_layout, &c.kv_layout}) {
    key.insert(key.end(), {l->seq_len, l->size, l->head_tail});
    add(l->documents);
    add(l->lengths);
    add(l->placed ? flatten(*l->placed) : std::vector<int64_t>{});
  }
  return key;
}

constexpr size_t kCachedPlans = 8;
thread_local std::vector<std::pair<std::vector<int64_t>, std::shared_ptr<const RingPlan::Tables>>>
    t_plans;  // most recently used first

}  // namespace

RingPlan::RingPlan(const Config& cfg) : cfg_(cfg) {
  for (const auto& p : cfg.kv_layout.positions)
    kv_sorted_.push_back(std::is_sorted(p.begin(), p.end()));
  std::vector<int64_t> key = plan_key(cfg);
  if (key.empty()) {
    t_ = build();
    return;
  }
  auto hit = std::find_if(t_plans.begin(), t_plans.end(),
                          [&key](const auto& e) { return e.first == key; });
  if (hit != t_plans.end()) {
    std::rotate(t_plans.begin(), hit, hit + 1);
  } else {
    t_plans.insert(t_plans.begin(), {std::move(key), build()});
    if (t_plans.size() > kCachedPlans) t_plans.pop_back();
  }
  t_ = t_plans.front().second;
}

std::shared_ptr<const RingPlan::Tables> RingPlan::build() const {
  const int64_t n = cfg_.size, rank = cfg_.rank;
  auto t = std::make_shared<Tables>();
  t->needs.assign(n * n, 0);
  t->offsets.push_back(0);
  for (int64_t d = 0; d < n; ++d) {
    bool any = false;
    for (int64_t r = 0; r < n; ++r) {
      t->needs[d * n + r] = !plan_pair(r, mod(r - d, n), /*any_only=*/true).empty();
      any = any || t->needs[d * n + r];
    }
    if (d > 0 && any) t->offsets.push_back(d);
  }
  // Only the rows a receiver reads travel (p2p and alltoall; the explicit
  // layouts of caches and pass-Q keep whole blocks).
  const bool compact = cfg_.rotate != Rotate::allgather && !cfg_.pass_q &&
                       !cfg_.kv_layout.is_explicit();
  for (size_t s = 0; s < t->offsets.size(); ++s) {
    const int64_t d = t->offsets[s], src = mod(rank - d, n), dst = mod(rank + d, n);
    t->calls.push_back(plan_pair(rank, src, /*any_only=*/false));
    t->recv.push_back(rows_read(t->calls.back(), kv_len(src), compact && s > 0));
    const bool sends = s > 0 && t->needs[d * n + dst];
    t->send.push_back(rows_read(sends ? plan_pair(dst, rank, false) : std::vector<Call>(),
                                kv_len(rank), compact && s > 0));
    if (t->recv.back().ranges.empty()) continue;
    // Each call's key rows lie inside one received range: index them there.
    const std::vector<Range>& got = t->recv.back().ranges;
    for (Call& c : t->calls.back()) {
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
  return t;
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

int64_t RingPlan::source(int64_t s) const { return mod(cfg_.rank - t_->offsets[s], cfg_.size); }
int64_t RingPlan::target(int64_t s) const { return mod(cfg_.rank + t_->offsets[s], cfg_.size); }

bool RingPlan::needs(int64_t rank, int64_t offset) const {
  return t_->needs[offset * cfg_.size + rank] != 0;
}

namespace {

Call make_call(Visibility kind, const std::vector<Piece>& qp, size_t a0, size_t a1,
               const std::vector<Piece>& kp, size_t b0, size_t b1) {
  Call c;
  c.kind = kind;
  c.q_local = qp[a0].local;
  c.q_len = qp[a1].local + qp[a1].global.len - c.q_local;
  c.k_local = kp[b0].local;
  c.k_len = kp[b1].local + kp[b1].global.len - c.k_local;
  return c;
}

}  // namespace

// The local block's runs of consecutive pieces whose square is causal in
// local order (each diagonal cell causal, those below full, those above
// empty: a cut document's front and back chunk) as one causal call each.
void RingPlan::causal_runs(const std::vector<Visibility>& cls, const std::vector<Piece>& qp,
                           const std::vector<Piece>& kp, std::vector<char>& done,
                           std::vector<Call>& calls) const {
  const size_t n = qp.size(), nk = kp.size();
  auto cell = [&](size_t a, size_t b) { return cls[a * nk + b]; };
  for (size_t a0 = 0; a0 < n && a0 < nk;) {
    if (cell(a0, a0) != Visibility::causal) {
      ++a0;
      continue;
    }
    size_t a1 = a0;
    auto joins = [&](size_t e) {
      if (e >= n || e >= nk || cell(e, e) != Visibility::causal) return false;
      for (size_t b = a0; b < e; ++b)
        if (cell(e, b) != Visibility::full || cell(b, e) != Visibility::empty) return false;
      return true;
    };
    while (joins(a1 + 1)) ++a1;
    calls.push_back(make_call(Visibility::causal, qp, a0, a1, kp, a0, a1));
    for (size_t a = a0; a <= a1; ++a)
      for (size_t b = a0; b <= a1; ++b) done[a * nk + b] = 1;
    a0 = a1 + 1;
  }
}

// The full cells left, as rectangles: each run of consecutive full cells of
// a row one call, and consecutive rows with the same runs merged.
void RingPlan::full_rectangles(const std::vector<Visibility>& cls, const std::vector<Piece>& qp,
                               const std::vector<Piece>& kp, std::vector<char>& done,
                               std::vector<Call>& calls) const {
  const size_t nq = qp.size(), nk = kp.size();
  auto runs = [&](size_t a) {
    std::vector<std::pair<size_t, size_t>> out;
    for (size_t b = 0; b < nk; ++b) {
      if (done[a * nk + b] || cls[a * nk + b] != Visibility::full) continue;
      if (!out.empty() && out.back().second + 1 == b)
        out.back().second = b;
      else
        out.push_back({b, b});
    }
    return out;
  };
  for (size_t a0 = 0; a0 < nq;) {
    const auto row = runs(a0);
    size_t a1 = a0;
    while (!row.empty() && a1 + 1 < nq && runs(a1 + 1) == row) ++a1;
    for (const auto& [b0, b1] : row) {
      calls.push_back(make_call(Visibility::full, qp, a0, a1, kp, b0, b1));
      for (size_t a = a0; a <= a1; ++a)
        for (size_t b = b0; b <= b1; ++b) done[a * nk + b] = 1;
    }
    a0 = a1 + 1;
  }
}

std::vector<Call> RingPlan::plan_pair(int64_t rank, int64_t src, bool any_only) const {
  if (cfg_.q_layout.is_explicit()) return plan_explicit(rank, src, any_only);
  const Mask& mask = cfg_.mask;
  const std::vector<Piece> qp = cfg_.q_layout.pieces(rank), kp = cfg_.kv_layout.pieces(src);
  const size_t nq = qp.size(), nk = kp.size();
  std::vector<Visibility> cls(nq * nk);
  bool any = false;
  std::vector<Call> calls;
  for (size_t a = 0; a < nq; ++a)
    for (size_t b = 0; b < nk; ++b) {
      const Visibility v = mask.classify(qp[a].global, kp[b].global);
      cls[a * nk + b] = v;
      any = any || v != Visibility::empty;
      if (any && any_only) {
        calls.emplace_back();
        return calls;
      }
    }
  if (!any) return calls;
  // A product of full pieces is one call (the dense ring, the load-balanced
  // causal ring's off-diagonal steps), the local head-tail block one causal
  // call ([A|B] x [A|B] with A before B), a cut document's chunks likewise.
  std::vector<char> done(nq * nk, 0);
  if (rank == src && cfg_.q_layout.seq_len == cfg_.kv_layout.seq_len)
    causal_runs(cls, qp, kp, done, calls);
  full_rectangles(cls, qp, kp, done, calls);
  for (size_t a = 0; a < nq; ++a)
    for (size_t b = 0; b < nk; ++b) {
      const Visibility v = cls[a * nk + b];
      const Piece &q = qp[a], &k = kp[b];
      if (done[a * nk + b] || v == Visibility::empty) continue;
      if (v == Visibility::causal) {
        calls.push_back(make_call(v, qp, a, a, kp, b, b));
        continue;
      }
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
