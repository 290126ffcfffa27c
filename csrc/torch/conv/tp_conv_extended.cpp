// tp_convolution on the extended copy of the local input (asymmetric halos,
// or shards narrower than a window).
#include "conv/tp_conv_impl.h"

namespace cplib {
namespace {

// [zero pad | left halo] x [right halo | zero pad] along p.dim, contiguous.
Tensor extend_input(const Group& g, const TpConvPlan& p, const Tensor& x) {
  auto ex = exchange_input_halos(g, p, x);
  Tensor ext = torch::stable::new_empty(x, p.extended_sizes(x));
  unpack_slab(ext, p.dim, p.left, torch::stable::contiguous(x));  // overlapped with the messages
  // The global border's padding.
  if (p.left > p.halo_left) {
    Tensor border = torch::stable::narrow(ext, p.dim, 0, p.left);
    torch::stable::zero_(border);
  }
  if (p.right > p.halo_right) {
    Tensor border = torch::stable::narrow(ext, p.dim, p.left + p.width, p.right);
    torch::stable::zero_(border);
  }
  ex->wait();
  if (p.halo_left) unpack_slab(ext, p.dim, 0, ex->from_left);
  if (p.halo_right) unpack_slab(ext, p.dim, p.left + p.width, ex->from_right);
  return ext;
}

}  // namespace

Tensor tp_conv_extended(const Group& g, const TpConvPlan& p, const Tensor& x, const Tensor& w,
                        const std::optional<Tensor>& b, int64_t groups) {
  return convolution(extend_input(g, p, x), w, b, p.stride, p.conv_padding, p.dilation, groups);
}

ConvGrads tp_conv_extended_backward(const Group& g, const TpConvPlan& p, const Tensor& grad_out,
                                    const Tensor& x, const Tensor& w, int64_t groups,
                                    std::array<bool, 3> mask) {
  // grad_input reads only the input's shape; grad_weight needs the halos.
  const Tensor input = mask[1] ? extend_input(g, p, x)
                               : torch::stable::new_empty(x, p.extended_sizes(x));
  auto [gi, gw, gb] = convolution_backward(grad_out, input, w, p.stride, p.conv_padding, p.dilation,
                                           groups, mask);
  if (gi.defined()) {
    const Tensor grad_ext = torch::stable::contiguous(gi);
    gi = pack_slab(grad_ext, p.dim, p.left, p.width);
    add_returned_halo_grads(g, p, gi, Slab{grad_ext, 0, p.halo_left},
                            Slab{grad_ext, p.left + p.width, p.halo_right});
  }
  return {gi, gw, gb};
}

void add_returned_halo_grads(const Group& g, const TpConvPlan& p, Tensor& grad_x,
                             const Slab& grad_halo_left, const Slab& grad_halo_right) {
  auto back = return_halo_grads(g, p, grad_x, grad_halo_left, grad_halo_right);
  back->wait();
  add_halo_grads(p, grad_x, *back);
}

}  // namespace cplib
