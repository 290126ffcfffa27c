// tp_convolution on the extended copy of the local input (asymmetric halos,
// or shards narrower than a window).
#include "conv/tp_conv_halo.h"
#include "conv/tp_conv_impl.h"

namespace cplib {
namespace {

// [zero pad | left halo] x [right halo | zero pad] along p.dim, contiguous.
at::Tensor extend_input(const PG& pg, const TpConvPlan& p, const at::Tensor& x) {
  auto ex = exchange_input_halos(pg, p, x);
  const at::Tensor xc = x.contiguous();
  at::Tensor ext = at::empty(p.extended_sizes(xc), xc.options());
  unpack_slab(ext, p.dim, p.left, xc);  // overlapped with the messages
  if (p.left > p.halo_left) ext.narrow(p.dim, 0, p.left).zero_();  // global border
  if (p.right > p.halo_right) ext.narrow(p.dim, p.left + p.width, p.right).zero_();
  ex->wait();
  if (p.halo_left) unpack_slab(ext, p.dim, 0, ex->from_left);
  if (p.halo_right) unpack_slab(ext, p.dim, p.left + p.width, ex->from_right);
  return ext;
}

}  // namespace

at::Tensor tp_conv_extended(const PG& pg, const TpConvPlan& p, const at::Tensor& x,
                            const at::Tensor& w, const c10::optional<at::Tensor>& b,
                            int64_t groups) {
  return at::convolution(extend_input(pg, p, x), w, b, p.stride, p.conv_padding, p.dilation,
                         false, zeros_like_params(p), groups);
}

ConvGrads tp_conv_extended_backward(const PG& pg, const TpConvPlan& p, const at::Tensor& grad_out,
                                    const at::Tensor& x, const at::Tensor& w, int64_t groups,
                                    std::array<bool, 3> mask) {
  // grad_input reads only the input's shape; grad_weight needs the halos.
  const at::Tensor input =
      mask[1] ? extend_input(pg, p, x) : at::empty(p.extended_sizes(x), x.options());
  const std::vector<int64_t> bias_sizes{w.size(0)};
  auto [gi, gw, gb] = at::convolution_backward(
      grad_out, input, w, mask[2] ? c10::optional<at::IntArrayRef>(bias_sizes) : c10::nullopt,
      p.stride, p.conv_padding, p.dilation, false, zeros_like_params(p), groups, mask);
  if (gi.defined()) {
    const at::Tensor g = gi.contiguous();
    gi = pack_slab(g, p.dim, p.left, p.width);
    add_returned_halo_grads(
        pg, p, gi, p.halo_left ? pack_slab(g, p.dim, 0, p.halo_left) : at::Tensor(),
        p.halo_right ? pack_slab(g, p.dim, p.left + p.width, p.halo_right) : at::Tensor());
  }
  return {gi, gw, gb};
}

void add_returned_halo_grads(const PG& pg, const TpConvPlan& p, at::Tensor& grad_x,
                             const at::Tensor& grad_halo_left, const at::Tensor& grad_halo_right) {
  auto back = return_halo_grads(pg, p, grad_x, grad_halo_left, grad_halo_right);
  back->wait();
  add_halo_grads(p, grad_x, *back);
}

}  // namespace cplib
