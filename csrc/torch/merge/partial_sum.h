// A sum of partial results over the steps of a ring, each row combined once:
// the partial attention outputs with their lse (the forward), or the partial
// gradients of q (the backward). Parts are held as their kernels gave them
// (in q's dtype) while their bytes stay within a budget, and combined in one
// pass at the end (combine_op.h) that rounds each element once into q's
// dtype: no widened copy of the whole output per step, no final cast. Past
// the budget (or past CPLIB_COMBINE_MAX_PARTS parts) the held parts are
// folded into an accumulator of the accumulator dtype, which later folds and
// the final combine read as one more part. A budget of 0 folds every part
// at once. A first fold of one part over every row in the accumulator
// dtype adopts that part as the accumulator, without a pass.
#pragma once

#include <utility>
#include <vector>

#include "common/aten.h"
#include "common/stable.h"
#include "merge/combine_op.h"

// Internal to the extension (torch's stable types are hidden).
#pragma GCC visibility push(hidden)

namespace cplib {

class PartialSum {
 public:
  // `sizes` (B, H, L, D) of the sum, in `acc`'s dtype on its device;
  // `weighted`: partial attention outputs with their lse (else a plain sum).
  PartialSum(std::vector<int64_t> sizes, const aten::Opts& acc, bool weighted,
             int64_t budget_bytes);
  // Makes room for a part of `bytes` (before the kernel that computes it,
  // so the fold's memory is freed before the part's is taken).
  void reserve(int64_t bytes);
  // A part of the sum: rows [row_offset, row_offset + data.size(2)); `lse`
  // its log-sum-exp (weighted) or undefined. Held, not copied.
  void add(const Tensor& data, const Tensor& lse, int64_t row_offset);
  // The sum in `dtype` (fresh, contiguous) and, weighted, its lse (the
  // accumulator dtype, contiguous). Rows no part covers: 0 (and lse -inf).
  std::pair<Tensor, Tensor> finish(ScalarType dtype);

 private:
  void fold();
  std::vector<CombinePart> parts_with_acc() const;
  // Rows [0, L) in `dtype`.
  bool is_whole(const CombinePart& p, ScalarType dtype) const;

  std::vector<int64_t> sizes_;
  aten::Opts acc_opts_;
  bool weighted_;
  int64_t budget_;
  std::vector<CombinePart> held_;
  int64_t held_bytes_ = 0;
  Tensor acc_, acc_lse_;  // defined once a fold happened
  bool adopted_ = false;  // acc_ is a part as its kernel gave it: never written
};

// The bytes a PartialSum of q's rows may hold: `factor` times the
// accumulator (float32, float64 for float64 inputs) of the whole sum. For
// fp16/bf16 holding saves a rounding per step; for every dtype it saves a
// pass over the accumulator per part (docs/merge.md).
int64_t held_budget(const Tensor& q, const std::vector<int64_t>& sizes, int64_t factor);

}  // namespace cplib

#pragma GCC visibility pop
