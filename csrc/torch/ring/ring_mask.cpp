#include "ring/ring_mask.h"

#include <algorithm>
#include <limits>

namespace cplib::ring {

bool Mask::dense() const {
  // A window side of S - 1 or more hides nothing.
  return !causal && bounds.size() <= 2 && left >= seq_len - 1 && right >= seq_len - 1;
}

int64_t Mask::doc_of(int64_t pos) const {
  return std::upper_bound(bounds.begin(), bounds.end(), pos) - bounds.begin() - 1;
}

bool Mask::band_empty(Range q, Range k) const {
  return k.end() - 1 < q.start - left || k.start > q.end() - 1 + right;
}

bool Mask::band_full(Range q, Range k) const {
  return k.start >= q.end() - 1 - left && k.end() - 1 <= q.start + right;
}

Visibility Mask::classify(Range q, Range k) const {
  if (q.empty() || k.empty() || band_empty(q, k)) return Visibility::empty;
  bool one_doc = true;
  if (bounds.size() > 2) {
    const int64_t q0 = doc_of(q.start), q1 = doc_of(q.end() - 1);
    const int64_t k0 = doc_of(k.start), k1 = doc_of(k.end() - 1);
    bool any = false;
    for (int64_t d = std::max(q0, k0); d <= std::min(q1, k1) && !any; ++d) {
      const int64_t lo = bounds[d], hi = bounds[d + 1];
      const Range qd{std::max(q.start, lo), std::min(q.end(), hi) - std::max(q.start, lo)};
      const Range kd{std::max(k.start, lo), std::min(k.end(), hi) - std::max(k.start, lo)};
      any = !band_empty(qd, kd);
    }
    if (!any) return Visibility::empty;
    one_doc = q0 == q1 && k0 == k1 && q0 == k0;
  }
  if (one_doc && band_full(q, k)) return Visibility::full;
  if (one_doc && causal && q.start == k.start && q.len == k.len && left >= q.len - 1)
    return Visibility::causal;
  return Visibility::partial;
}

Range Mask::visible_keys(Range q, Range k) const {
  int64_t lo = std::max(k.start, q.start - left);
  int64_t hi = std::min(k.end(), q.end() + right);
  if (bounds.size() > 2 && !q.empty()) {
    lo = std::max(lo, bounds[doc_of(q.start)]);
    hi = std::min(hi, bounds[doc_of(q.end() - 1) + 1]);
  }
  return {lo, std::max<int64_t>(hi - lo, 0)};
}

std::pair<Tensor, Tensor> Mask::build(Range q, Range k, const aten::Opts& opts) const {
  std::vector<int64_t> qp(static_cast<size_t>(std::max<int64_t>(q.len, 0)));
  std::vector<int64_t> kp(static_cast<size_t>(std::max<int64_t>(k.len, 0)));
  for (size_t i = 0; i < qp.size(); ++i) qp[i] = q.start + static_cast<int64_t>(i);
  for (size_t j = 0; j < kp.size(); ++j) kp[j] = k.start + static_cast<int64_t>(j);
  return build_at(qp, kp, opts);
}

std::pair<Tensor, Tensor> Mask::build_at(const std::vector<int64_t>& q_pos,
                                         const std::vector<int64_t>& k_pos,
                                         const aten::Opts& opts) const {
  // Per-row bounds and documents on the host (one pass over the positions),
  // the (rows x columns) comparison on the device.
  const size_t lq = q_pos.size(), lk = k_pos.size();
  std::vector<int64_t> lo(lq), hi(lq);
  for (size_t i = 0; i < lq; ++i) lo[i] = q_pos[i] - left, hi[i] = q_pos[i] + right;
  const Device dev = opts.device;
  const Tensor kj = aten::view(aten::from_host(k_pos, dev), {1, static_cast<int64_t>(lk)});
  auto column = [&dev](const std::vector<int64_t>& v) {
    return aten::view(aten::from_host(v, dev), {static_cast<int64_t>(v.size()), 1});
  };
  Tensor visible = aten::logical_and(aten::ge(kj, column(lo)), aten::le(kj, column(hi)));
  if (bounds.size() > 2) {
    std::vector<int64_t> qd(lq), kd(lk);
    for (size_t i = 0; i < lq; ++i) qd[i] = doc_of(q_pos[i]);
    for (size_t j = 0; j < lk; ++j) kd[j] = doc_of(k_pos[j]);
    const Tensor kdt = aten::view(aten::from_host(kd, dev), {1, static_cast<int64_t>(lk)});
    visible = aten::logical_and(visible, aten::eq(kdt, column(qd)));
  }
  Tensor additive = aten::where_scalars(visible, 0.0, -std::numeric_limits<double>::infinity(),
                                        opts);
  return {additive, aten::logical_not(aten::any_dim(visible, 1))};
}

}  // namespace cplib::ring
