// cplib_c::tp_convolution and cplib_c::tp_convolution_backward: convolution
// of an input sharded along one dim, with the windows that cross shard
// borders served by a neighbour halo exchange (see tp_conv_plan.cpp for the
// layout). grad_weight / grad_bias are this rank's partial sums: the caller
// all-reduces them over the group to get the full gradients.
#include <array>
#include <string>
#include <utility>

#include "comm/handshake.h"
#include "conv/tp_conv_impl.h"

namespace cplib {
namespace {

struct Resolved {
  Group group;
  TpConvPlan plan;
};

Resolved resolve(const Tensor& x, const Tensor& w, const std::optional<Tensor>& b,
                 const std::vector<int64_t>& stride, const std::vector<int64_t>& padding,
                 const std::vector<int64_t>& dilation, int64_t groups, int64_t shard_dim,
                 const std::string& group_name, const Tensor& grad_out = Tensor(),
                 bool handshake = true) {
  Group group = resolve_group(group_name);
  TpConvPlan plan;
  if (!handshake) {  // covered by the forward's handshake: the checks raise here
    plan = make_tp_conv_plan(x, w, b, stride, padding, dilation, groups, shard_dim, group.rank,
                             group.size);
    return {std::move(group), std::move(plan)};
  }
  Handshake hs("tp_convolution");
  hs.validate([&] {
    plan = make_tp_conv_plan(x, w, b, stride, padding, dilation, groups, shard_dim, group.rank,
                             group.size);
    // Shards may differ in width along the sharded dim: that width is a
    // local length, everything else must agree.
    CallSignature& sig = hs.sig();
    sig.add_meta("x", x, plan.dim);
    sig.add_meta("weight", w);
    sig.add_meta("bias", b ? *b : Tensor());
    for (const auto& [what, values] :
         {std::pair{"stride", &stride}, {"padding", &padding}, {"dilation", &dilation}}) {
      sig.add(std::string(what) + " length", static_cast<int64_t>(values->size()));
      for (size_t i = 0; i < values->size(); ++i)
        sig.add(std::string(what) + "[" + std::to_string(i) + "]", (*values)[i]);
    }
    sig.add("groups", groups);
    sig.add("shard_dim", plan.dim);
    if (grad_out.defined()) sig.add_meta("grad_out", grad_out, plan.dim);
    hs.set_lengths({x.size(plan.dim)});
  });
  hs.exchange(group);
  return {std::move(group), std::move(plan)};
}

Tensor fresh_contiguous(const Tensor& t) { return t.defined() ? torch::stable::contiguous(t) : t; }

Tensor tp_convolution(Tensor x, Tensor w, std::optional<Tensor> b, std::vector<int64_t> stride,
                      std::vector<int64_t> padding, std::vector<int64_t> dilation, int64_t groups,
                      int64_t shard_dim, std::string group_name) {
  Resolved r = resolve(x, w, b, stride, padding, dilation, groups, shard_dim, group_name);
  const TpConvPlan& p = r.plan;
  Tensor out;
  if (!p.exchange)
    out = convolution(x, w, b, p.stride, p.padding, p.dilation, groups);
  else if (p.patched)
    out = tp_conv_patched(r.group, p, x, w, b, groups);
  else
    out = tp_conv_extended(r.group, p, x, w, b, groups);
  return fresh_contiguous(out);
}

std::tuple<Tensor, Tensor, Tensor> backward_impl(
    const Tensor& grad_out, const Tensor& x, const Tensor& w, const std::vector<int64_t>& stride,
    const std::vector<int64_t>& padding, const std::vector<int64_t>& dilation, int64_t groups,
    int64_t shard_dim, const std::string& group_name, const std::vector<bool>& output_mask,
    bool handshake) {
  CPLIB_CHECK_VALUE(output_mask.size() == 3, "cplib.tp_conv: output_mask must have 3 entries, got ",
                    output_mask.size());
  const std::array<bool, 3> mask{output_mask[0], output_mask[1], output_mask[2]};
  Resolved r = resolve(x, w, std::nullopt, stride, padding, dilation, groups, shard_dim, group_name,
                       grad_out, handshake);
  const TpConvPlan& p = r.plan;
  ConvGrads grads;
  if (!p.exchange)
    grads = convolution_backward(grad_out, x, w, p.stride, p.padding, p.dilation, groups, mask);
  else if (p.patched)
    grads = tp_conv_patched_backward(r.group, p, grad_out, x, w, groups, mask);
  else
    grads = tp_conv_extended_backward(r.group, p, grad_out, x, w, groups, mask);
  auto& [gi, gw, gb] = grads;
  return {fresh_contiguous(gi), fresh_contiguous(gw), fresh_contiguous(gb)};
}

std::tuple<Tensor, Tensor, Tensor> tp_convolution_backward(
    Tensor grad_out, Tensor x, Tensor w, std::vector<int64_t> stride, std::vector<int64_t> padding,
    std::vector<int64_t> dilation, int64_t groups, int64_t shard_dim, std::string group_name,
    std::vector<bool> output_mask) {
  return backward_impl(grad_out, x, w, stride, padding, dilation, groups, shard_dim, group_name,
                       output_mask, true);
}

// Internal: the backward through autograd, covered by its forward's handshake.
std::tuple<Tensor, Tensor, Tensor> tp_convolution_backward_covered(
    Tensor grad_out, Tensor x, Tensor w, std::vector<int64_t> stride, std::vector<int64_t> padding,
    std::vector<int64_t> dilation, int64_t groups, int64_t shard_dim, std::string group_name,
    std::vector<bool> output_mask) {
  return backward_impl(grad_out, x, w, stride, padding, dilation, groups, shard_dim, group_name,
                       output_mask, false);
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(cplib_c, m) {
  m.def(
      "tp_convolution(Tensor x, Tensor w, Tensor? b, int[] stride, int[] padding, int[] dilation, "
      "int groups, int shard_dim, str group_name) -> Tensor");
  m.def(
      "tp_convolution_backward(Tensor grad_out, Tensor x, Tensor w, int[] stride, int[] padding, "
      "int[] dilation, int groups, int shard_dim, str group_name, bool[3] output_mask) "
      "-> (Tensor, Tensor, Tensor)");
  m.def(
      "tp_convolution_backward_covered(Tensor grad_out, Tensor x, Tensor w, int[] stride, "
      "int[] padding, int[] dilation, int groups, int shard_dim, str group_name, "
      "bool[3] output_mask) -> (Tensor, Tensor, Tensor)");
}

STABLE_TORCH_LIBRARY_IMPL(cplib_c, CPU, m) {
  m.impl("tp_convolution", CPLIB_BOX(&tp_convolution));
  m.impl("tp_convolution_backward", CPLIB_BOX(&tp_convolution_backward));
  m.impl("tp_convolution_backward_covered", CPLIB_BOX(&tp_convolution_backward_covered));
}

#ifdef CPLIB_WITH_CUDA
STABLE_TORCH_LIBRARY_IMPL(cplib_c, CUDA, m) {
  m.impl("tp_convolution", CPLIB_BOX(&tp_convolution));
  m.impl("tp_convolution_backward", CPLIB_BOX(&tp_convolution_backward));
  m.impl("tp_convolution_backward_covered", CPLIB_BOX(&tp_convolution_backward_covered));
}
#endif

}  // namespace cplib
