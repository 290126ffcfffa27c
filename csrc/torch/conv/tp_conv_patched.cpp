// tp_convolution without copying the local input: x is convolved with
// padding `left` (== right) along the shard dim, which is exact except for
// the `left` / `right` border output columns whose windows reach into a
// neighbour; those are recomputed from small [halo | edge] slabs. The main
// convolution (forward) and the main convolution_backward overlap the halo
// exchanges.
#include "conv/tp_conv_halo.h"
#include "conv/tp_conv_impl.h"

namespace cplib {
namespace {

std::vector<int64_t> main_padding(const TpConvPlan& p) {
  auto pad = p.padding;
  pad[p.dim - 2] = p.left;
  return pad;
}

// [halo | x's first `halo` columns] (left) or [x's last columns | halo] (right).
at::Tensor border_slab(const TpConvPlan& p, const at::Tensor& x, const at::Tensor& halo,
                       bool left) {
  const at::Tensor edge = x.narrow(p.dim, left ? 0 : p.width - p.halo, p.halo);
  return left ? at::cat({halo, edge}, p.dim) : at::cat({edge, halo}, p.dim);
}

}  // namespace

at::Tensor tp_conv_patched(const PG& pg, const TpConvPlan& p, const at::Tensor& x,
                           const at::Tensor& w, const c10::optional<at::Tensor>& b,
                           int64_t groups) {
  auto ex = exchange_input_halos(pg, p, x);
  const auto no_out_pad = zeros_like_params(p);
  at::Tensor out = at::convolution(x, w, b, p.stride, main_padding(p), p.dilation, false,
                                   no_out_pad, groups)
                       .contiguous();
  ex->wait();
  auto patch = [&](const at::Tensor& halo, bool left) {
    at::Tensor cols = at::convolution(border_slab(p, x, halo, left), w, b, p.stride,
                                      p.conv_padding, p.dilation, false, no_out_pad, groups);
    unpack_slab(out, p.dim, left ? 0 : out.size(p.dim) - p.right, cols.contiguous());
  };
  if (p.halo_left) patch(ex->from_left, true);
  if (p.halo_right) patch(ex->from_right, false);
  return out;
}

ConvGrads tp_conv_patched_backward(const PG& pg, const TpConvPlan& p, const at::Tensor& grad_out,
                                   const at::Tensor& x, const at::Tensor& w, int64_t groups,
                                   std::array<bool, 3> mask) {
  // The main convolution_backward below sees zeros where the halos are. Its
  // grad_input of x is already right (padding does not change it); what it
  // misses is grad_weight's halo term and the gradient of the halo columns
  // themselves. Both are linear in a slab holding only the halo. The halo
  // columns' gradient needs grad_out and w alone, so it is computed and sent
  // back first; both exchanges then run behind the main backward, as the
  // forward's runs behind its main convolution.
  const auto no_out_pad = zeros_like_params(p);
  auto slab_backward = [&](const at::Tensor& halo, bool left, std::array<bool, 3> m) {
    const int64_t width = left ? p.left : p.right;
    const at::Tensor g = grad_out.narrow(p.dim, left ? 0 : grad_out.size(p.dim) - width, width);
    auto shape = x.sizes().vec();
    shape[p.dim] = width + p.halo;
    at::Tensor slab = at::zeros(shape, x.options());
    if (halo.defined()) unpack_slab(slab, p.dim, left ? 0 : p.halo, halo);
    auto grads = at::convolution_backward(g, slab, w, c10::nullopt, p.stride, p.conv_padding,
                                          p.dilation, false, no_out_pad, groups, m);
    // The halo columns' part of the slab gradient.
    if (m[0]) std::get<0>(grads) = pack_slab(std::get<0>(grads), p.dim, left ? 0 : p.halo, width);
    return grads;
  };

  // Every rank joins an exchange when its gradient is wanted, even one that only sends.
  std::unique_ptr<NeighbourExchange> halos_in, grads_back;
  if (mask[1]) halos_in = exchange_input_halos(pg, p, x);
  if (mask[0]) {
    at::Tensor grad_halo_left, grad_halo_right;
    if (p.halo_left) grad_halo_left = std::get<0>(slab_backward({}, true, {true, false, false}));
    if (p.halo_right)
      grad_halo_right = std::get<0>(slab_backward({}, false, {true, false, false}));
    grads_back = return_halo_grads(pg, p, x, grad_halo_left, grad_halo_right);
  }

  const std::vector<int64_t> bias_sizes{w.size(0)};
  auto [gi, gw, gb] = at::convolution_backward(
      grad_out, x, w, mask[2] ? c10::optional<at::IntArrayRef>(bias_sizes) : c10::nullopt,
      p.stride, main_padding(p), p.dilation, false, no_out_pad, groups, mask);

  if (halos_in) {
    halos_in->wait();
    auto add_halo_term = [&](const at::Tensor& halo, bool left) {
      gw.add_(std::get<1>(slab_backward(halo, left, {false, true, false})));
    };
    if (p.halo_left) add_halo_term(halos_in->from_left, true);
    if (p.halo_right) add_halo_term(halos_in->from_right, false);
  }
  if (grads_back) {
    gi = gi.contiguous();
    grads_back->wait();
    add_halo_grads(p, gi, *grads_back);
  }
  return {gi, gw, gb};
}

}  // namespace cplib
