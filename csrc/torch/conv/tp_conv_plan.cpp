#include "conv/tp_conv_plan.h"

#include <algorithm>

#include "common/checks.h"
#include "common/format.h"

namespace cplib {
namespace {

using torch::headeronly::IntHeaderOnlyArrayRef;

// A conv parameter given once (applies to every spatial dim) or per dim.
std::vector<int64_t> per_dim(const std::vector<int64_t>& v, int64_t n, const char* name,
                             int64_t min_value) {
  const IntHeaderOnlyArrayRef shown(v);
  CPLIB_CHECK_VALUE(!v.empty() && (v.size() == 1 || static_cast<int64_t>(v.size()) == n),
                    "cplib.tp_conv: ", name, "=", shown, " must have 1 or ", n, " entries for a ",
                    n, "-d convolution");
  std::vector<int64_t> out(n, v[0]);
  for (int64_t i = 0; i < n; ++i) {
    out[i] = v.size() == 1 ? v[0] : v[i];
    CPLIB_CHECK_VALUE(out[i] >= min_value, "cplib.tp_conv: ", name, "=", shown,
                      " must be >= ", min_value);
  }
  return out;
}

void check_tensors(const Tensor& x, const Tensor& w, const std::optional<Tensor>& b,
                   int64_t groups) {
  CPLIB_CHECK_VALUE(x.dim() >= 3 && x.dim() <= 5, "cplib.tp_conv: x must be 3-D, 4-D or 5-D ",
                    "(batch, channels, spatial...), got shape ", x.sizes());
  CPLIB_CHECK_VALUE(w.dim() == x.dim(), "cplib.tp_conv: weight must have ", x.dim(),
                    " dimensions like x, got shape ", w.sizes());
  CPLIB_CHECK_VALUE(x.scalar_type() == w.scalar_type() && x.device() == w.device(),
                    "cplib.tp_conv: x (", x.scalar_type(), ", ", x.device(), ") and weight (",
                    w.scalar_type(), ", ", w.device(), ") must share dtype and device");
  CPLIB_CHECK_VALUE(is_floating(x.scalar_type()), "cplib.tp_conv: x must be floating ",
                    "point, got ", x.scalar_type());
  CPLIB_CHECK_VALUE(groups >= 1, "cplib.tp_conv: groups=", groups, " must be >= 1");
  CPLIB_CHECK_VALUE(w.size(0) % groups == 0 && x.size(1) == w.size(1) * groups,
                    "cplib.tp_conv: groups=", groups, " does not fit x channels ", x.size(1),
                    " and weight shape ", w.sizes(), " (need x.size(1) == weight.size(1) * groups",
                    " and weight.size(0) divisible by groups)");
  if (b.has_value() && b->defined()) {
    CPLIB_CHECK_VALUE(b->dim() == 1 && b->size(0) == w.size(0), "cplib.tp_conv: bias must have ",
                      "shape (", w.size(0), ",), got ", b->sizes());
    CPLIB_CHECK_VALUE(b->scalar_type() == x.scalar_type() && b->device() == x.device(),
                      "cplib.tp_conv: bias must share dtype and device with x");
  }
}

}  // namespace

std::vector<int64_t> TpConvPlan::extended_sizes(const Tensor& x) const {
  const auto sizes = x.sizes();
  std::vector<int64_t> s(sizes.begin(), sizes.end());
  s[dim] = left + width + right;
  return s;
}

TpConvPlan make_tp_conv_plan(const Tensor& x, const Tensor& w, const std::optional<Tensor>& b,
                             const std::vector<int64_t>& stride,
                             const std::vector<int64_t>& padding,
                             const std::vector<int64_t>& dilation, int64_t groups,
                             int64_t shard_dim, int64_t rank, int64_t size) {
  check_tensors(x, w, b, groups);
  const int64_t nsp = x.dim() - 2;
  TpConvPlan p;
  p.stride = per_dim(stride, nsp, "stride", 1);
  p.padding = per_dim(padding, nsp, "padding", 0);
  p.dilation = per_dim(dilation, nsp, "dilation", 1);
  p.conv_padding = p.padding;
  p.dim = checked_dim(shard_dim, x.dim(), "shard_dim");
  p.rank = rank;
  p.size = size;
  CPLIB_CHECK_NOT_IMPLEMENTED(p.dim != 1, "cplib.tp_conv: shard_dim=", shard_dim,
                              " is the channel dim; shard the batch dim (0) or a spatial dim (2..",
                              x.dim() - 1, ")");
  if (p.dim == 0 || size == 1) return p;  // every window is local

  const int64_t i = p.dim - 2;
  const int64_t k = w.size(p.dim), s = p.stride[i], pad = p.padding[i], d = p.dilation[i];
  const int64_t span = d * (k - 1) + 1;  // input columns one output column reads
  p.width = x.size(p.dim);
  if (s != 1) {
    // Windows tile the input exactly: each shard is a whole number of them.
    CPLIB_CHECK_NOT_IMPLEMENTED(pad == 0 && span == s, "cplib.tp_conv: stride=", s,
                                " along shard_dim=", p.dim, " is supported only when it equals",
                                " the kernel span dilation*(kernel-1)+1 (", span,
                                ") and padding along that dim is 0 (got padding=", pad, ")");
    CPLIB_CHECK_VALUE(p.width % s == 0, "cplib.tp_conv: local width ", p.width,
                      " along shard_dim=", p.dim, " must be a multiple of stride=", s,
                      " so that shards hold whole windows");
    return p;
  }
  const int64_t halo = span - 1;
  if (halo == 0 && pad == 0) return p;
  // Output column o reads input [o - pad, o - pad + halo]; it belongs to the
  // rank holding input column o - pad + lh, so each window needs lh columns
  // on its left and rh on its right (split like the upstream prototype).
  const int64_t lh = halo / 2, rh = halo - lh;
  const bool first = rank == 0, last = rank == size - 1;
  p.exchange = true;
  p.conv_padding[i] = 0;  // borders are padded explicitly, interiors get halos
  p.left = first ? pad : lh;
  p.right = last ? pad : rh;
  p.halo_left = first ? 0 : lh;
  p.halo_right = last ? 0 : rh;
  p.send_left = first ? 0 : rh;
  p.send_right = last ? 0 : lh;
  p.halo = halo;
  p.lh = lh;
  p.rh = rh;
  p.patched = p.left == p.right && p.width >= halo;
  CPLIB_CHECK_VALUE(p.width >= std::max(p.send_left, p.send_right), "cplib.tp_conv: local width ",
                    p.width, " along shard_dim=", p.dim, " on rank ", rank,
                    " is smaller than the halo its neighbours need (",
                    std::max(p.send_left, p.send_right), " = part of dilation*(kernel-1) = ", halo,
                    ")");
  CPLIB_CHECK_VALUE(p.left + p.width + p.right >= span, "cplib.tp_conv: local width ", p.width,
                    " along shard_dim=", p.dim, " on rank ", rank,
                    " leaves no output column for kernel span ", span);
  return p;
}

}  // namespace cplib
