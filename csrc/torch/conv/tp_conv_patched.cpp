// tp_convolution without copying the local input: x is convolved with
// padding `left` (== right) along the shard dim, which is exact except for
// the `left` / `right` border output columns whose windows reach into a
// neighbour; those are recomputed from small [halo | edge] slabs. The main
// convolution overlaps the halo exchange.
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
  // grad_weight needs the halo values; every rank joins when it does, even
  // one that only sends.
  std::unique_ptr<NeighbourExchange> ex;
  if (mask[1]) ex = exchange_input_halos(pg, p, x);
  const auto no_out_pad = zeros_like_params(p);
  const std::vector<int64_t> bias_sizes{w.size(0)};
  auto [gi, gw, gb] = at::convolution_backward(
      grad_out, x, w, mask[2] ? c10::optional<at::IntArrayRef>(bias_sizes) : c10::nullopt,
      p.stride, main_padding(p), p.dilation, false, no_out_pad, groups, mask);
  if (ex) ex->wait();

  // The border columns' windows saw zeros where the halo is. grad_input of x
  // is already right (padding does not change it); what is missing is
  // grad_weight's halo term and the gradient of the halo columns themselves.
  // Both are linear in the slab, so a slab holding only the halo gives them.
  auto border = [&](const at::Tensor& halo, bool left) -> at::Tensor {
    const int64_t width = left ? p.left : p.right;
    const int64_t out_w = grad_out.size(p.dim);
    const at::Tensor g = grad_out.narrow(p.dim, left ? 0 : out_w - width, width);
    auto shape = x.sizes().vec();
    shape[p.dim] = width + p.halo;
    at::Tensor slab = at::zeros(shape, x.options());
    if (mask[1]) unpack_slab(slab, p.dim, left ? 0 : p.halo, halo);
    auto [gs, gws, unused] = at::convolution_backward(
        g, slab, w, c10::nullopt, p.stride, p.conv_padding, p.dilation, false, no_out_pad, groups,
        {mask[0], mask[1], false});
    if (mask[1]) gw.add_(gws);
    return mask[0] ? pack_slab(gs, p.dim, left ? 0 : p.halo, width) : at::Tensor();
  };
  at::Tensor grad_halo_left, grad_halo_right;
  if (p.halo_left) grad_halo_left = border(ex ? ex->from_left : at::Tensor(), true);
  if (p.halo_right) grad_halo_right = border(ex ? ex->from_right : at::Tensor(), false);
  if (gi.defined()) {
    gi = gi.contiguous();
    add_returned_halo_grads(pg, p, gi, grad_halo_left, grad_halo_right);
  }
  return {gi, gw, gb};
}

}  // namespace cplib
