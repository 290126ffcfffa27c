// cplib_c::merge_partial_: the fused (out, lse) merge as an op, used by the
// ring and exposed for tests and the bandwidth benchmark.
#include "merge/merge_op.h"

#include "common/c_core.h"
#include "common/format.h"
#include "cplib/merge.h"

namespace cplib {
namespace {

// Elements that share memory: a dim of more than one element with stride 0
// (an expanded tensor).
bool has_internal_overlap(const Tensor& t) {
  for (int64_t d = 0; d < t.dim(); ++d)
    if (t.size(d) > 1 && t.stride(d) == 0) return true;
  return false;
}

const char* name_of(ScalarType t) { return torch::headeronly::toString(t); }

cplib_merge_params merge_params(Tensor& out, Tensor& lse, const Tensor& blk_out,
                                const Tensor& blk_lse, int64_t row_offset) {
  CPLIB_CHECK_VALUE(out.dim() == 4 && blk_out.dim() == 4 && lse.dim() == 3 && blk_lse.dim() == 3,
                    "cplib.merge_partial_: expected out/blk_out (B,H,L,D) and lse/blk_lse (B,H,L), "
                    "got ",
                    out.sizes(), ", ", lse.sizes(), ", ", blk_out.sizes(), ", ", blk_lse.sizes());
  const ScalarType acc = out.scalar_type();
  CPLIB_CHECK_VALUE(acc == ScalarType::Float || acc == ScalarType::Double,
                    "cplib.merge_partial_: accumulator dtype must be float32 or float64, got ",
                    name_of(acc));
  CPLIB_CHECK_VALUE(lse.scalar_type() == acc && blk_lse.scalar_type() == acc,
                    "cplib.merge_partial_: lse and blk_lse must have the accumulator dtype ",
                    name_of(acc));
  CPLIB_CHECK_VALUE(acc == ScalarType::Float || blk_out.scalar_type() == ScalarType::Double,
                    "cplib.merge_partial_: a float64 accumulator needs a float64 block");
  // Rows that share memory (an expanded `out`) would be merged into each other.
  for (const auto& [name, t] : {std::pair{"out", &out}, std::pair{"lse", &lse}})
    CPLIB_CHECK_VALUE(!has_internal_overlap(*t), "cplib.merge_partial_: ", name, " (strides ",
                      t->strides(),
                      ") has elements that share memory (expanded?); pass a "
                      "dense tensor");
  CPLIB_CHECK_VALUE(out.device() == lse.device() && out.device() == blk_out.device() &&
                        out.device() == blk_lse.device(),
                    "cplib.merge_partial_: out, lse, blk_out and blk_lse must be on one device, "
                    "got ",
                    out.device(), ", ", lse.device(), ", ", blk_out.device(), ", ",
                    blk_lse.device());
  const int64_t B = blk_out.size(0), H = blk_out.size(1), R = blk_out.size(2), D = blk_out.size(3);
  CPLIB_CHECK_VALUE(out.size(0) == B && out.size(1) == H && out.size(3) == D && lse.size(0) == B &&
                        lse.size(1) == H && blk_lse.size(0) == B && blk_lse.size(1) == H &&
                        blk_lse.size(2) == R,
                    "cplib.merge_partial_: shapes disagree: out ", out.sizes(), ", lse ",
                    lse.sizes(), ", blk_out ", blk_out.sizes(), ", blk_lse ", blk_lse.sizes());
  CPLIB_CHECK_VALUE(row_offset >= 0 && row_offset + R <= out.size(2) && lse.size(2) == out.size(2),
                    "cplib.merge_partial_: rows [", row_offset, ", ", row_offset + R,
                    ") do not fit an accumulator of ", out.size(2), " rows");
  cplib_merge_params p{};
  p.out = out.mutable_data_ptr();
  p.lse = lse.mutable_data_ptr();
  p.blk_out = blk_out.const_data_ptr();
  p.blk_lse = blk_lse.const_data_ptr();
  p.acc_dtype = to_cplib_dtype(acc);
  p.blk_dtype = to_cplib_dtype(blk_out.scalar_type());
  p.batch = B;
  p.heads = H;
  p.rows = R;
  p.dim = D;
  p.row_offset = row_offset;
  for (int i = 0; i < 4; ++i) {
    p.out_stride[i] = out.stride(i);
    p.blk_out_stride[i] = blk_out.stride(i);
  }
  for (int i = 0; i < 3; ++i) {
    p.lse_stride[i] = lse.stride(i);
    p.blk_lse_stride[i] = blk_lse.stride(i);
  }
  return p;
}

void merge_partial_op(Tensor out, Tensor lse, Tensor blk_out, Tensor blk_lse, int64_t row_offset) {
  merge_partial(out, lse, blk_out, blk_lse, row_offset);
}

}  // namespace

void merge_partial(Tensor& out, Tensor& lse, const Tensor& blk_out, const Tensor& blk_lse,
                   int64_t row_offset) {
  cplib_merge_params p = merge_params(out, lse, blk_out, blk_lse, row_offset);
  if (out.is_cuda()) {
#ifdef CPLIB_WITH_CUDA
    check_status(cplib_merge_cuda(&p, current_cuda_stream(out)), "CUDA merge");
#else
    raise(ErrorKind::runtime, "cplib was built without CUDA");
#endif
  } else {
    check_status(cplib_merge_cpu(&p), "CPU merge");
  }
}

STABLE_TORCH_LIBRARY_FRAGMENT(cplib_c, m) {
  m.def(
      "merge_partial_(Tensor(a!) out, Tensor(b!) lse, Tensor blk_out, Tensor blk_lse, "
      "int row_offset=0) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(cplib_c, CPU, m) {
  m.impl("merge_partial_", CPLIB_BOX(&merge_partial_op));
}

#ifdef CPLIB_WITH_CUDA
STABLE_TORCH_LIBRARY_IMPL(cplib_c, CUDA, m) {
  m.impl("merge_partial_", CPLIB_BOX(&merge_partial_op));
}
#endif

}  // namespace cplib
