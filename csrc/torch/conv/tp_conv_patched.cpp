// tp_convolution without copying the local input: x is convolved with
// padding `left` (== right) along the shard dim, which is exact except for
// the `left` / `right` border output columns whose windows reach into a
// neighbour; those are recomputed from small [halo | edge] slabs. The main
// convolution (forward) and the main convolution_backward overlap the halo
// exchanges.
#include "conv/tp_conv_impl.h"

namespace cplib {
namespace {

std::vector<int64_t> main_padding(const TpConvPlan& p) {
  auto pad = p.padding;
  pad[p.dim - 2] = p.left;
  return pad;
}

// [halo | x's first `halo` columns] (left) or [x's last columns | halo] (right).
Tensor border_slab(const TpConvPlan& p, Tensor x, const Tensor& halo, bool left) {
  const Tensor edge = torch::stable::narrow(x, p.dim, left ? 0 : p.width - p.halo, p.halo);
  return left ? cat({halo, edge}, p.dim) : cat({edge, halo}, p.dim);
}

}  // namespace

Tensor tp_conv_patched(const Group& g, const TpConvPlan& p, const Tensor& x, const Tensor& w,
                       const std::optional<Tensor>& b, int64_t groups) {
  auto ex = exchange_input_halos(g, p, x);
  Tensor out = torch::stable::contiguous(
      convolution(x, w, b, p.stride, main_padding(p), p.dilation, groups));
  ex->wait();
  auto patch = [&](const Tensor& halo, bool left) {
    const Tensor cols = convolution(border_slab(p, x, halo, left), w, b, p.stride, p.conv_padding,
                                    p.dilation, groups);
    unpack_slab(out, p.dim, left ? 0 : out.size(p.dim) - p.right, torch::stable::contiguous(cols));
  };
  if (p.halo_left) patch(ex->from_left, true);
  if (p.halo_right) patch(ex->from_right, false);
  return out;
}

ConvGrads tp_conv_patched_backward(const Group& g, const TpConvPlan& p, const Tensor& grad_out,
                                   const Tensor& x, const Tensor& w, int64_t groups,
                                   std::array<bool, 3> mask) {
  // The main convolution_backward below sees zeros where the halos are. Its
  // grad_input of x is already right (padding does not change it); what it
  // misses is grad_weight's halo term and the gradient of the halo columns
  // themselves. Both are linear in a slab holding only the halo. The halo
  // columns' gradient needs grad_out and w alone, so it is computed and sent
  // back first; both exchanges then run behind the main backward, as the
  // forward's runs behind its main convolution.
  auto slab_backward = [&](const Tensor& halo, bool left, std::array<bool, 3> m) {
    const int64_t width = left ? p.left : p.right;
    Tensor go = grad_out;
    const Tensor g_cols = torch::stable::narrow(go, p.dim, left ? 0 : grad_out.size(p.dim) - width,
                                                width);
    const auto sizes = x.sizes();
    std::vector<int64_t> shape(sizes.begin(), sizes.end());
    shape[p.dim] = width + p.halo;
    Tensor slab = torch::stable::new_zeros(x, shape);
    if (halo.defined()) unpack_slab(slab, p.dim, left ? 0 : p.halo, halo);
    return convolution_backward(g_cols, slab, w, p.stride, p.conv_padding, p.dilation, groups, m);
  };

  // Every rank joins an exchange when its gradient is wanted, even one that only sends.
  std::unique_ptr<NeighbourExchange> halos_in, grads_back;
  if (mask[1]) halos_in = exchange_input_halos(g, p, x);
  if (mask[0]) {
    // The halo columns' part of each slab gradient goes back to its owner.
    Slab grad_halo_left, grad_halo_right;
    if (p.halo_left)
      grad_halo_left = {std::get<0>(slab_backward({}, true, {true, false, false})), 0, p.left};
    if (p.halo_right)
      grad_halo_right = {std::get<0>(slab_backward({}, false, {true, false, false})), p.halo,
                         p.right};
    grads_back = return_halo_grads(g, p, x, grad_halo_left, grad_halo_right);
  }

  auto [gi, gw, gb] = convolution_backward(grad_out, x, w, p.stride, main_padding(p), p.dilation,
                                           groups, mask);

  if (halos_in) {
    halos_in->wait();
    auto add_halo_term = [&](const Tensor& halo, bool left) {
      gw = torch::stable::subtract(gw, std::get<1>(slab_backward(halo, left, {false, true, false})),
                                   -1.0);
    };
    if (p.halo_left) add_halo_term(halos_in->from_left, true);
    if (p.halo_right) add_halo_term(halos_in->from_right, false);
  }
  if (grads_back) {
    gi = torch::stable::contiguous(gi);
    grads_back->wait();
    add_halo_grads(p, gi, *grads_back);
  }
  return {gi, gw, gb};
}

}  // namespace cplib
