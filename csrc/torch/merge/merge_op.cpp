// cplib_c::merge_partial_: the fused (out, lse) merge as an op, used by the
// ring and exposed for tests and the bandwidth benchmark.
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <torch/library.h>

#include "cplib/merge.h"
#include "common/dtype.h"
#include "merge/merge_op.h"

#ifdef CPLIB_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

namespace cplib {

static cplib_merge_params merge_params(at::Tensor& out, at::Tensor& lse, const at::Tensor& blk_out,
                                const at::Tensor& blk_lse, int64_t row_offset) {
  TORCH_CHECK_VALUE(out.dim() == 4 && blk_out.dim() == 4 && lse.dim() == 3 && blk_lse.dim() == 3,
                    "cplib.merge_partial_: expected out/blk_out (B,H,L,D) and lse/blk_lse (B,H,L), got ",
                    out.sizes(), ", ", lse.sizes(), ", ", blk_out.sizes(), ", ", blk_lse.sizes());
  TORCH_CHECK_VALUE(out.scalar_type() == at::kFloat || out.scalar_type() == at::kDouble,
                    "cplib.merge_partial_: accumulator dtype must be float32 or float64, got ",
                    out.scalar_type());
  TORCH_CHECK_VALUE(lse.scalar_type() == out.scalar_type() &&
                        blk_lse.scalar_type() == out.scalar_type(),
                    "cplib.merge_partial_: lse and blk_lse must have the accumulator dtype ",
                    out.scalar_type());
  TORCH_CHECK_VALUE(out.scalar_type() == at::kFloat || blk_out.scalar_type() == at::kDouble,
                    "cplib.merge_partial_: a float64 accumulator needs a float64 block");
  // Rows that share memory (an expanded `out`) would be merged into each other.
  for (const auto& [name, t] : {std::pair{"out", &out}, std::pair{"lse", &lse}})
    TORCH_CHECK_VALUE(at::has_internal_overlap(*t) != at::MemOverlap::Yes,
                      "cplib.merge_partial_: ", name, " (strides ", t->strides(),
                      ") has elements that share memory (expanded?); pass a dense tensor");
  TORCH_CHECK_VALUE(out.device() == lse.device() && out.device() == blk_out.device() &&
                        out.device() == blk_lse.device(),
                    "cplib.merge_partial_: out, lse, blk_out and blk_lse must be on one device, "
                    "got ", out.device(), ", ", lse.device(), ", ", blk_out.device(), ", ",
                    blk_lse.device());
  const int64_t B = blk_out.size(0), H = blk_out.size(1), R = blk_out.size(2), D = blk_out.size(3);
  TORCH_CHECK_VALUE(out.size(0) == B && out.size(1) == H && out.size(3) == D &&
                        lse.size(0) == B && lse.size(1) == H && blk_lse.size(0) == B &&
                        blk_lse.size(1) == H && blk_lse.size(2) == R,
                    "cplib.merge_partial_: shapes disagree: out ", out.sizes(), ", lse ",
                    lse.sizes(), ", blk_out ", blk_out.sizes(), ", blk_lse ", blk_lse.sizes());
  TORCH_CHECK_VALUE(row_offset >= 0 && row_offset + R <= out.size(2) && lse.size(2) == out.size(2),
                    "cplib.merge_partial_: rows [", row_offset, ", ", row_offset + R,
                    ") do not fit an accumulator of ", out.size(2), " rows");
  cplib_merge_params p{};
  p.out = out.data_ptr();
  p.lse = lse.data_ptr();
  p.blk_out = blk_out.const_data_ptr();
  p.blk_lse = blk_lse.const_data_ptr();
  p.acc_dtype = to_cplib_dtype(out.scalar_type());
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

void merge_partial(at::Tensor& out, at::Tensor& lse, const at::Tensor& blk_out,
                   const at::Tensor& blk_lse, int64_t row_offset) {
  cplib_merge_params p = merge_params(out, lse, blk_out, blk_lse, row_offset);
  if (out.is_cuda()) {
#ifdef CPLIB_WITH_CUDA
    check_status(cplib_merge_cuda(&p, at::cuda::getCurrentCUDAStream(out.get_device()).stream()),
                 "CUDA merge");
#else
    TORCH_CHECK(false, "cplib was built without CUDA");
#endif
  } else {
    check_status(cplib_merge_cpu(&p), "CPU merge");
  }
}

namespace {

void merge_partial_op(at::Tensor out, at::Tensor lse, const at::Tensor& blk_out,
                      const at::Tensor& blk_lse, int64_t row_offset) {
  merge_partial(out, lse, blk_out, blk_lse, row_offset);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cplib_c, m) {
  m.def(
      "merge_partial_(Tensor(a!) out, Tensor(b!) lse, Tensor blk_out, Tensor blk_lse, "
      "int row_offset=0) -> ()");
}

TORCH_LIBRARY_IMPL(cplib_c, CPU, m) { m.impl("merge_partial_", &merge_partial_op); }

#ifdef CPLIB_WITH_CUDA
TORCH_LIBRARY_IMPL(cplib_c, CUDA, m) { m.impl("merge_partial_", &merge_partial_op); }
#endif

}  // namespace cplib
