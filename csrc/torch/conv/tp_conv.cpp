// cplib_c::tp_convolution and cplib_c::tp_convolution_backward: convolution
// of an input sharded along one dim, with the windows that cross shard
// borders served by a neighbour halo exchange (see tp_conv_plan.cpp for the
// layout). grad_weight / grad_bias are this rank's partial sums: the caller
// all-reduces them over the group to get the full gradients.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "comm/comm.h"
#include "comm/handshake.h"
#include "conv/tp_conv_impl.h"
#include "conv/tp_conv_plan.h"

namespace cplib {
namespace {

struct Resolved {
  PG pg;
  TpConvPlan plan;
};

Resolved resolve(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& b,
                 at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                 int64_t groups, int64_t shard_dim, c10::string_view group_name,
                 const at::Tensor& grad_out = at::Tensor()) {
  const std::string_view name(group_name.data(), group_name.size());
  PG pg = resolve_group(name);
  Handshake hs("tp_convolution");
  TpConvPlan plan;
  hs.validate([&] {
    plan = make_tp_conv_plan(x, w, b, stride, padding, dilation, groups, shard_dim,
                             pg->getRank(), pg->getSize());
    // Shards may differ in width along the sharded dim: that width is a
    // local length, everything else must agree.
    CallSignature& sig = hs.sig();
    sig.add_meta("x", x, plan.dim);
    sig.add_meta("weight", w);
    sig.add_meta("bias", b ? *b : at::Tensor());
    for (auto [what, values] : {std::pair{"stride", stride}, {"padding", padding},
                                {"dilation", dilation}}) {
      sig.add(std::string(what) + " length", static_cast<int64_t>(values.size()));
      for (size_t i = 0; i < values.size(); ++i)
        sig.add(std::string(what) + "[" + std::to_string(i) + "]", values[i]);
    }
    sig.add("groups", groups);
    sig.add("shard_dim", plan.dim);
    if (grad_out.defined()) sig.add_meta("grad_out", grad_out, plan.dim);
    hs.set_lengths({x.size(plan.dim)});
  });
  hs.exchange(name, pg, x.device());
  return {std::move(pg), std::move(plan)};
}

at::Tensor fresh_contiguous(const at::Tensor& t) {
  return t.defined() ? t.contiguous() : t;
}

at::Tensor tp_convolution(const at::Tensor& x, const at::Tensor& w,
                          const c10::optional<at::Tensor>& b, at::IntArrayRef stride,
                          at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                          int64_t shard_dim, c10::string_view group_name) {
  Resolved r = resolve(x, w, b, stride, padding, dilation, groups, shard_dim, group_name);
  const TpConvPlan& p = r.plan;
  at::Tensor out;
  if (!p.exchange)
    out = at::convolution(x, w, b, p.stride, p.padding, p.dilation, /*transposed=*/false,
                          zeros_like_params(p), groups);
  else if (p.patched)
    out = tp_conv_patched(r.pg, p, x, w, b, groups);
  else
    out = tp_conv_extended(r.pg, p, x, w, b, groups);
  return fresh_contiguous(out);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> tp_convolution_backward(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& w, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups, int64_t shard_dim,
    c10::string_view group_name, std::array<bool, 3> output_mask) {
  Resolved r = resolve(x, w, c10::nullopt, stride, padding, dilation, groups, shard_dim,
                       group_name, grad_out);
  const TpConvPlan& p = r.plan;
  ConvGrads grads;
  if (!p.exchange) {
    const std::vector<int64_t> bias_sizes{w.size(0)};
    grads = at::convolution_backward(
        grad_out, x, w,
        output_mask[2] ? c10::optional<at::IntArrayRef>(bias_sizes) : c10::nullopt, p.stride,
        p.padding, p.dilation, /*transposed=*/false, zeros_like_params(p), groups, output_mask);
  } else if (p.patched) {
    grads = tp_conv_patched_backward(r.pg, p, grad_out, x, w, groups, output_mask);
  } else {
    grads = tp_conv_extended_backward(r.pg, p, grad_out, x, w, groups, output_mask);
  }
  auto& [gi, gw, gb] = grads;
  return {fresh_contiguous(gi), fresh_contiguous(gw), fresh_contiguous(gb)};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cplib_c, m) {
  m.def(
      "tp_convolution(Tensor x, Tensor w, Tensor? b, int[] stride, int[] padding, int[] dilation, "
      "int groups, int shard_dim, str group_name) -> Tensor");
  m.def(
      "tp_convolution_backward(Tensor grad_out, Tensor x, Tensor w, int[] stride, int[] padding, "
      "int[] dilation, int groups, int shard_dim, str group_name, bool[3] output_mask) "
      "-> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(cplib_c, CPU, m) {
  m.impl("tp_convolution", &tp_convolution);
  m.impl("tp_convolution_backward", &tp_convolution_backward);
}

#ifdef CPLIB_WITH_CUDA
TORCH_LIBRARY_IMPL(cplib_c, CUDA, m) {
  m.impl("tp_convolution", &tp_convolution);
  m.impl("tp_convolution_backward", &tp_convolution_backward);
}
#endif

}  // namespace cplib
