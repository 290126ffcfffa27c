// cplib_c::combine_partials_: the one-pass combine as an op (the ring calls
// combine_partials directly; the op serves the tests, the CUDA-against-C
// check and the benchmark).
#include "merge/combine_op.h"

#include "common/c_core.h"
#include "common/format.h"
#include "cplib/combine.h"

namespace cplib {
namespace {

constexpr const char* kOp = "cplib.combine_partials_";

void copy_strides(const Tensor& t, int64_t* out, int n) {
  for (int i = 0; i < n; ++i) out[i] = t.stride(i);
}

cplib_combine_params params_of(Tensor& out, Tensor* lse, const std::vector<CombinePart>& parts) {
  CPLIB_CHECK_VALUE(out.dim() == 4, kOp, ": out must be (B, H, L, D), got ", out.sizes());
  CPLIB_CHECK_VALUE(parts.size() <= CPLIB_COMBINE_MAX_PARTS, kOp, ": at most ",
                    CPLIB_COMBINE_MAX_PARTS, " parts, got ", parts.size());
  const bool f64 = out.scalar_type() == ScalarType::Double;
  const ScalarType acc = f64 ? ScalarType::Double : ScalarType::Float;
  const bool weighted = lse != nullptr;
  cplib_combine_params p{};
  p.out = out.mutable_data_ptr();
  p.out_dtype = to_cplib_dtype(out.scalar_type());
  p.acc_dtype = to_cplib_dtype(acc);
  p.weighted = weighted ? 1 : 0;
  p.batch = out.size(0);
  p.heads = out.size(1);
  p.rows = out.size(2);
  p.dim = out.size(3);
  copy_strides(out, p.out_stride, 4);
  if (weighted) {
    CPLIB_CHECK_VALUE(lse->dim() == 3 && lse->size(0) == p.batch && lse->size(1) == p.heads &&
                          lse->size(2) == p.rows && lse->scalar_type() == acc,
                      kOp, ": lse must be ", torch::headeronly::toString(acc), " (", p.batch, ", ",
                      p.heads, ", ", p.rows, "), got ", lse->sizes());
    p.lse = lse->mutable_data_ptr();
    copy_strides(*lse, p.lse_stride, 3);
  }
  p.nparts = static_cast<int>(parts.size());
  for (size_t j = 0; j < parts.size(); ++j) {
    const CombinePart& part = parts[j];
    const Tensor& d = part.data;
    CPLIB_CHECK_VALUE(d.dim() == 4 && d.size(0) == p.batch && d.size(1) == p.heads &&
                          d.size(3) == p.dim && part.row_offset >= 0 &&
                          part.row_offset + d.size(2) <= p.rows,
                      kOp, ": part ", j, " ", d.sizes(), " at row ", part.row_offset,
                      " does not fit out ", out.sizes());
    CPLIB_CHECK_VALUE(d.device() == out.device(), kOp, ": part ", j, " is on ", d.device(),
                      ", out on ", out.device());
    cplib_combine_part& q = p.parts[j];
    q.data = d.const_data_ptr();
    q.dtype = to_cplib_dtype(d.scalar_type());
    q.row_offset = part.row_offset;
    q.rows = d.size(2);
    copy_strides(d, q.stride, 4);
    CPLIB_CHECK_VALUE(part.lse.defined() == weighted, kOp, ": part ", j,
                      weighted ? " has no lse (a weighted combine)" : " has an lse (a plain sum)");
    if (weighted) {
      CPLIB_CHECK_VALUE(part.lse.dim() == 3 && part.lse.size(2) == q.rows &&
                            part.lse.size(0) == p.batch && part.lse.size(1) == p.heads &&
                            part.lse.scalar_type() == acc,
                        kOp, ": part ", j, "'s lse must be ", torch::headeronly::toString(acc),
                        " (", p.batch, ", ", p.heads, ", ", q.rows, "), got ", part.lse.sizes());
      q.lse = part.lse.const_data_ptr();
      copy_strides(part.lse, q.lse_stride, 3);
    }
  }
  if (out.device().type() == DeviceType::Meta) {
    // No storage (the CUDA glue's probe): the dtype and row checks still run.
    static char no_storage;
    p.out = p.lse = &no_storage;
    for (int j = 0; j < p.nparts; ++j) p.parts[j].data = p.parts[j].lse = &no_storage;
    if (!weighted) p.lse = nullptr;
    for (int j = 0; !weighted && j < p.nparts; ++j) p.parts[j].lse = nullptr;
  }
  CPLIB_CHECK_VALUE(cplib_combine_check(&p) == CPLIB_OK, kOp, ": dtypes out of reach: out ",
                    torch::headeronly::toString(out.scalar_type()),
                    ", parts of the accumulator dtype and at most one other, a float64 "
                    "combine all float64");
  return p;
}

void combine_partials_op(Tensor out, Tensor lse, std::vector<Tensor> parts,
                         std::vector<Tensor> lses, std::vector<int64_t> offsets) {
  CPLIB_CHECK_VALUE(offsets.size() == parts.size() && (lses.empty() || lses.size() == parts.size()),
                    kOp, ": ", parts.size(), " parts, ", lses.size(), " lses and ", offsets.size(),
                    " row offsets");
  std::vector<CombinePart> list;
  for (size_t j = 0; j < parts.size(); ++j)
    list.push_back({parts[j], lses.empty() ? Tensor() : lses[j], offsets[j]});
  combine_partials(out, lses.empty() ? nullptr : &lse, list);
}

}  // namespace

void combine_partials(Tensor& out, Tensor* lse, const std::vector<CombinePart>& parts) {
  const cplib_combine_params p = params_of(out, lse, parts);
  if (out.device().type() == DeviceType::Meta) return;  // shapes only (the CUDA glue's probe)
  if (out.is_cuda()) {
#ifdef CPLIB_WITH_CUDA
    check_status(cplib_combine_cuda(&p, current_cuda_stream(out)), "CUDA combine");
#else
    raise(ErrorKind::runtime, "cplib was built without CUDA");
#endif
  } else {
    check_status(cplib_combine_cpu(&p), "CPU combine");
  }
}

STABLE_TORCH_LIBRARY_FRAGMENT(cplib_c, m) {
  // lses empty: a plain sum (lse is then not written).
  m.def(
      "combine_partials_(Tensor(a!) out, Tensor(b!) lse, Tensor[] parts, Tensor[] lses, "
      "int[] row_offsets) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(cplib_c, CPU, m) {
  m.impl("combine_partials_", CPLIB_BOX(&combine_partials_op));
}

#ifdef CPLIB_WITH_CUDA
STABLE_TORCH_LIBRARY_IMPL(cplib_c, CUDA, m) {
  m.impl("combine_partials_", CPLIB_BOX(&combine_partials_op));
}
#endif

}  // namespace cplib
