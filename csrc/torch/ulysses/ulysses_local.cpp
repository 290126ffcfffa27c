// The attention each Ulysses rank runs on its heads over the whole sequence:
// the shared block kernels (attention/) with a world of one (CPU flash; CUDA flash,
// efficient or cuDNN as SDPA would choose), K/V expanded to q's heads only
// for the kernel, and outputs in fixed layouts (so the fake kernel can state
// them): the kernel's own tensor when it already has that layout, else one copy.
#include <array>
#include <optional>
#include <tuple>
#include <vector>

#include "attention/block.h"
#include "attention/checks.h"
#include "attention/heads.h"
#include "attention/sinks.h"
#include "common/aten.h"
#include "common/format.h"
#include "common/stable.h"
#include "ulysses/ulysses.h"

namespace cplib::ulysses {

namespace {

// An empty (B, H, S, D) tensor whose memory is ordered as dims `order` (outermost first).
Tensor empty_ordered(const std::vector<int64_t>& sizes, std::array<int64_t, 4> order,
                     const aten::Opts& opts) {
  std::vector<int64_t> strides(4);
  int64_t stride = 1;
  for (int i = 3; i >= 0; --i) {
    strides[order[i]] = stride;
    stride *= sizes[order[i]];
  }
  return aten::empty_strided(sizes, strides, opts);
}

constexpr std::array<int64_t, 4> kSeqMajor{2, 0, 1, 3};  // (S, B, H, D)
constexpr std::array<int64_t, 4> kBSHD{0, 2, 1, 3};      // (B, S, H, D)

// A kernel output as it is when it already has dtype and the layout `order`, else a copy that has.
Tensor in_layout(const Tensor& t, std::array<int64_t, 4> order, ScalarType dtype) {
  Tensor want = empty_ordered(aten::sizes_of(t), order, aten::opts_of(t).dtype_(dtype));
  if (t.scalar_type() == dtype && t.strides().vec() == want.strides().vec()) return t;
  aten::copy_(want, t);
  return want;
}

}  // namespace

std::tuple<Tensor, Tensor> local_sdpa(const Tensor& q, const Tensor& k, const Tensor& v,
                                      bool is_causal, std::optional<double> scale, int64_t backend,
                                      const Tensor& sinks) {
  aten::NoGradGuard no_grad;
  const attention::BlockConfig cfg = attention::check_local_args("ulysses_local_sdpa", q, k, v,
                                                                 is_causal, scale, backend);
  if (sinks.defined()) attention::check_sinks("ulysses_local_sdpa", q, sinks);
  attention::HeadExpander expand_k(cfg.groups, k, k.size(2)), expand_v(cfg.groups, v, v.size(2));
  attention::BlockResult r = attention::block_forward(cfg, q, expand_k(k), expand_v(v), is_causal);
  const auto acc = attention::acc_dtype(q);
  if (sinks.defined()) {  // scaled in the accumulator dtype, then cast once
    Tensor out_acc = aten::to(r.out, acc);
    r.lse = attention::apply_sinks(out_acc, r.lse, sinks);
    r.out = out_acc;
  }
  Tensor out = in_layout(r.out, kSeqMajor, q.scalar_type());
  Tensor lse = aten::contiguous(aten::to(r.lse, acc));
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor> local_sdpa_backward(const Tensor& grad_out, const Tensor& q,
                                                       const Tensor& k, const Tensor& v,
                                                       const Tensor& out, const Tensor& lse,
                                                       bool is_causal, std::optional<double> scale,
                                                       int64_t backend) {
  aten::NoGradGuard no_grad;
  const attention::BlockConfig cfg = attention::check_local_args("ulysses_local_sdpa_backward", q,
                                                                 k, v, is_causal, scale, backend);
  const std::vector<int64_t> out_sizes{q.size(0), q.size(1), q.size(2), v.size(3)};
  CPLIB_CHECK_VALUE(grad_out.sizes().vec() == out_sizes && out.sizes().vec() == out_sizes,
                    "cplib.ulysses_local_sdpa_backward: grad_out ", grad_out.sizes(), " and out ",
                    out.sizes(), " must have shape ", format_sizes(out_sizes));
  CPLIB_CHECK_VALUE(lse.dim() == 3 && lse.size(0) == q.size(0) && lse.size(1) == q.size(1) &&
                        lse.size(2) == q.size(2) && lse.scalar_type() == attention::acc_dtype(q),
                    "cplib.ulysses_local_sdpa_backward: lse must be ", attention::acc_dtype(q),
                    " of shape (B, H, S), got ", lse.scalar_type(), " ", lse.sizes());
  attention::HeadExpander expand_k(cfg.groups, k, k.size(2)), expand_v(cfg.groups, v, v.size(2));
  auto [gq, gk, gv] = attention::block_backward(cfg, grad_out, q, expand_k(k), expand_v(v), out,
                                                aten::contiguous(lse), is_causal);
  const auto dt = q.scalar_type();
  Tensor dq = in_layout(gq, kBSHD, dt);
  auto reduce = [&](const Tensor& g, const Tensor& like) {
    if (cfg.groups == 1) return in_layout(g, kBSHD, dt);
    Tensor acc = empty_ordered(aten::sizes_of(like), kBSHD, aten::opts_of(like));
    attention::reduce_heads_into(acc, g, cfg.groups, /*accumulate=*/false);
    return acc;
  };
  return {dq, reduce(gk, k), reduce(gv, v)};
}

}  // namespace cplib::ulysses
