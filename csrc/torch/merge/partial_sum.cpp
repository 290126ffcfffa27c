#include "merge/partial_sum.h"

#include "cplib/combine.h"

namespace cplib {

PartialSum::PartialSum(std::vector<int64_t> sizes, const aten::Opts& acc, bool weighted,
                       int64_t budget_bytes)
    : sizes_(std::move(sizes)), acc_opts_(acc), weighted_(weighted), budget_(budget_bytes) {}

std::vector<CombinePart> PartialSum::parts_with_acc() const {
  std::vector<CombinePart> parts;
  if (acc_.defined()) parts.push_back({acc_, acc_lse_, 0});
  parts.insert(parts.end(), held_.begin(), held_.end());
  return parts;
}

bool PartialSum::is_whole(const CombinePart& p, ScalarType dtype) const {
  return p.row_offset == 0 && p.data.size(2) == sizes_[2] && p.data.scalar_type() == dtype;
}

void PartialSum::fold() {
  if (held_.empty()) return;
  // A first fold of one part over every row, in the accumulator dtype, is
  // that part: it becomes the accumulator without a pass over it. It is not
  // written in place (its kernel may share it): the next fold writes afresh.
  if (!acc_.defined() && held_.size() == 1 && is_whole(held_[0], acc_opts_.dtype)) {
    acc_ = held_[0].data;
    acc_lse_ = held_[0].lse;
    adopted_ = true;
    held_.clear();
    held_bytes_ = 0;
    return;
  }
  const std::vector<CombinePart> parts = parts_with_acc();
  if (!acc_.defined() || adopted_) acc_ = aten::empty(sizes_, acc_opts_);
  adopted_ = false;
  // The values in place (the accumulator is part 0, covering every row with
  // its strides; each element is read before it is written, by one thread);
  // the lse, a row's few values, into a fresh tensor: a row's lanes all read
  // the old one.
  Tensor lse = weighted_ ? aten::empty({sizes_[0], sizes_[1], sizes_[2]}, acc_opts_) : Tensor();
  combine_partials(acc_, weighted_ ? &lse : nullptr, parts);
  acc_lse_ = lse;
  held_.clear();
  held_bytes_ = 0;
}

void PartialSum::reserve(int64_t bytes) {
  const size_t slots = held_.size() + (acc_.defined() ? 1 : 0) + 1;
  if (held_bytes_ + bytes > budget_ || slots > CPLIB_COMBINE_MAX_PARTS) fold();
}

void PartialSum::add(const Tensor& data, const Tensor& lse, int64_t row_offset) {
  if (held_.size() + (acc_.defined() ? 1 : 0) + 1 > CPLIB_COMBINE_MAX_PARTS) fold();
  held_.push_back({data, weighted_ ? lse : Tensor(), row_offset});
  held_bytes_ += aten::nbytes(data);
  // A budget of 0 (or a part reserve did not make room for) folds at once.
  if (held_bytes_ > budget_) fold();
}

std::pair<Tensor, Tensor> PartialSum::finish(ScalarType dtype) {
  const std::vector<int64_t> lse_sizes{sizes_[0], sizes_[1], sizes_[2]};
  // The accumulator alone (an adopted part may need contiguous copies).
  if (held_.empty() && acc_.defined() && dtype == acc_opts_.dtype) {
    if (!adopted_) return {acc_, acc_lse_};
    return {aten::contiguous(acc_), weighted_ ? aten::contiguous(acc_lse_) : Tensor()};
  }
  // One part over every row, fresh from its kernel, already in `dtype`:
  // it is the sum (only its lse may need a contiguous copy).
  if (held_.size() == 1 && !acc_.defined() && is_whole(held_[0], dtype) &&
      held_[0].data.is_contiguous())
    return {held_[0].data, weighted_ ? aten::contiguous(held_[0].lse) : Tensor()};
  Tensor out = aten::empty(sizes_, acc_opts_.dtype_(dtype));
  Tensor lse = weighted_ ? aten::empty(lse_sizes, acc_opts_) : Tensor();
  combine_partials(out, weighted_ ? &lse : nullptr, parts_with_acc());
  held_.clear();
  acc_ = acc_lse_ = Tensor();
  adopted_ = false;
  return {out, lse};
}

int64_t held_budget(const Tensor& q, const std::vector<int64_t>& sizes, int64_t factor) {
  const int64_t acc_bytes = q.scalar_type() == ScalarType::Double ? 8 : 4;
  return factor * aten::numel_of(sizes) * acc_bytes;
}

}  // namespace cplib
