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

std::pair<at::Tensor, at::Tensor> Mask::build(Range q, Range k,
                                              const at::TensorOptions& opts) const {
  const auto idx = opts.dtype(at::kLong);
  return build_at(at::arange(q.start, q.end(), idx), at::arange(k.start, k.end(), idx), opts);
}

std::pair<at::Tensor, at::Tensor> Mask::build_at(const at::Tensor& q_pos, const at::Tensor& k_pos,
                                                 const at::TensorOptions& opts) const {
  const at::Tensor qi = q_pos.unsqueeze(1), kj = k_pos.unsqueeze(0);
  at::Tensor visible = kj.ge(qi - left).logical_and_(kj.le(qi + right));
  if (bounds.size() > 2) {
    const at::Tensor b = at::tensor(bounds, opts.dtype(at::kLong));
    visible.logical_and_(at::searchsorted(b, qi, /*out_int32=*/false, /*right=*/true)
                             .eq(at::searchsorted(b, kj, false, true)));
  }
  at::Tensor additive = at::zeros({q_pos.size(0), k_pos.size(0)}, opts);
  additive.masked_fill_(visible.logical_not(), -std::numeric_limits<double>::infinity());
  return {additive, visible.any(1).logical_not_()};
}

}  // namespace cplib::ring
