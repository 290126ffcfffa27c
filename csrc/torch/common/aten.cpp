#include "common/aten.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <string>

namespace cplib::aten {
namespace {

using torch::headeronly::IntHeaderOnlyArrayRef;

template <size_t N>
Tensor first(std::array<StableIValue, N>& s) {
  return ret<Tensor>(s[0]);
}

Tensor scalar(double v, const Tensor& like) {
  return torch::stable::full({}, v, like.scalar_type(), std::nullopt, like.device());
}

}  // namespace

NoGradGuard::NoGradGuard() : prev_(aoti_torch_grad_mode_is_enabled()) {
  aoti_torch_grad_mode_set_enabled(false);
}

NoGradGuard::~NoGradGuard() { aoti_torch_grad_mode_set_enabled(prev_); }

Opts opts_of(const Tensor& t) { return {t.scalar_type(), t.device()}; }

int64_t numel_of(const std::vector<int64_t>& sizes) {
  int64_t n = 1;
  for (const int64_t s : sizes) n *= s;
  return n;
}

std::vector<int64_t> sizes_of(const Tensor& t) { return t.sizes().vec(); }

int64_t nbytes(const Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

Tensor empty(const std::vector<int64_t>& sizes, const Opts& o) {
  return torch::stable::empty(sizes, o.dtype, std::nullopt, o.device);
}

Tensor zeros(const std::vector<int64_t>& sizes, const Opts& o) {
  return torch::stable::full(sizes, 0.0, o.dtype, std::nullopt, o.device);
}

Tensor full(const std::vector<int64_t>& sizes, double value, const Opts& o) {
  return torch::stable::full(sizes, value, o.dtype, std::nullopt, o.device);
}

Tensor empty_strided(const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides,
                     const Opts& o) {
  auto s = call("aten::empty_strided", "", sizes, strides, std::optional<ScalarType>(o.dtype),
                std::nullopt, std::optional<Device>(o.device), std::nullopt);
  return first(s);
}

Tensor from_host(const std::vector<int64_t>& values, const Device& device) {
  std::vector<int64_t> v = values;
  const std::vector<int64_t> sizes{static_cast<int64_t>(v.size())}, strides{1};
  Tensor blob = torch::stable::from_blob(v.data(), sizes, strides, Device(DeviceType::CPU),
                                         ScalarType::Long);
  // A copy that owns its memory (`v` dies here). To a GPU without waiting
  // for it: `v` is pageable, which the driver copies to its staging memory
  // before the call returns (a blocking copy would synchronise the stream).
  return torch::stable::to(blob, device, /*non_blocking=*/device.type() != DeviceType::CPU,
                           /*copy=*/true);
}

Tensor on_device(const Tensor& t, const Device& device) {
  if (t.device() == device) return t;
  // From host memory through a pageable copy of our own: staged at once (see
  // from_host), so the transfer waits for nothing and no later write to `t`
  // (pinned or not) can race it.
  const Tensor src = t.device().type() == DeviceType::CPU
                         ? torch::stable::to(t, Device(DeviceType::CPU), false, /*copy=*/true)
                         : t;
  return torch::stable::to(src, device, /*non_blocking=*/true);
}

std::vector<int64_t> to_host(const Tensor& t) {
  const Tensor h = torch::stable::contiguous(
      torch::stable::to(t, ScalarType::Long, std::nullopt, Device(DeviceType::CPU)));
  const int64_t* p = h.const_data_ptr<int64_t>();
  return {p, p + h.numel()};
}

Tensor narrow(const Tensor& t, int64_t dim, int64_t start, int64_t len) {
  Tensor self = t;
  return torch::stable::narrow(self, dim, start, len);
}

Tensor reinterpret(const Tensor& t, const std::vector<int64_t>& sizes,
                   const std::vector<int64_t>& strides, int64_t offset) {
  CPLIB_CHECK_VALUE(sizes.size() == strides.size() && offset >= 0, "cplib: internal view with ",
                    sizes.size(), " sizes, ", strides.size(), " strides and offset ", offset);
  AtenTensorHandle out = nullptr;
  // The shim's offset is added to t's own storage offset.
  check_dispatch(aoti_torch__reinterpret_tensor(t.get(), static_cast<int64_t>(sizes.size()),
                                                sizes.data(), strides.data(), offset, &out),
                 "_reinterpret_tensor", "");
  return Tensor(out);
}

Tensor rows(const Tensor& t, int64_t dim, int64_t start, int64_t len) {
  const int64_t n = t.size(dim);
  CPLIB_CHECK_VALUE(start >= 0 && len >= 0 && start + len <= n, "cplib: rows [", start, ", ",
                    start + len, ") of a dim of ", n);
  if (start == 0 && len == n) return t;
  std::vector<int64_t> sizes = sizes_of(t), strides = t.strides().vec();
  sizes[dim] = len;
  return reinterpret(t, sizes, strides, start * strides[dim]);
}

std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> strides(sizes.size(), 1);
  for (size_t i = sizes.size(); i-- > 1;)
    strides[i - 1] = strides[i] * std::max<int64_t>(sizes[i], 1);
  return strides;
}

Tensor carve(const Tensor& buf, const std::vector<int64_t>& sizes, int64_t offset) {
  CPLIB_CHECK_VALUE(buf.is_contiguous() && offset >= 0 && offset + numel_of(sizes) <= buf.numel(),
                    "cplib: ", numel_of(sizes), " elements at ", offset, " of a buffer of ",
                    buf.numel());
  return reinterpret(buf, sizes, contiguous_strides(sizes), offset);
}

Tensor view(const Tensor& t, const std::vector<int64_t>& sizes) {
  return torch::stable::view(t, sizes);
}

Tensor flat(const Tensor& t) { return torch::stable::view(t, {-1}); }

Tensor expand(const Tensor& t, const std::vector<int64_t>& sizes) {
  auto s = call("aten::expand", "", t, sizes, false);
  return first(s);
}

Tensor permute(const Tensor& t, const std::vector<int64_t>& dims) {
  auto s = call("aten::permute", "", t, dims);
  return first(s);
}

Tensor movedim(const Tensor& t, int64_t source, int64_t destination) {
  auto s = call("aten::movedim", "int", t, source, destination);
  return first(s);
}

Tensor reshape(const Tensor& t, const std::vector<int64_t>& sizes) {
  return torch::stable::reshape(t, sizes);
}

Tensor repeat(const Tensor& t, const std::vector<int64_t>& reps) {
  auto s = call("aten::repeat", "", t, reps);
  return first(s);
}

Tensor to(const Tensor& t, ScalarType dtype) {
  return torch::stable::to(t, dtype, std::nullopt, std::nullopt);
}

Tensor to(const Tensor& t, const Device& device) { return torch::stable::to(t, device); }

Tensor contiguous(const Tensor& t) { return torch::stable::contiguous(t); }

void copy_(const Tensor& dst, const Tensor& src) {
  Tensor d = dst;
  torch::stable::copy_(d, src);
}

void zero_(const Tensor& t) {
  Tensor d = t;
  torch::stable::zero_(d);
}

void fill_(const Tensor& t, double value) { torch::stable::fill_(t, value); }

Tensor add(const Tensor& a, const Tensor& b) { return torch::stable::subtract(a, b, -1.0); }

void add_(const Tensor& a, const Tensor& b) { copy_(a, add(a, b)); }

void mul_(const Tensor& a, const Tensor& b) {
  auto s = call("aten::mul_", "Tensor", a, b);
  first(s);
}

Tensor subtract(const Tensor& a, const Tensor& b) { return torch::stable::subtract(a, b); }

Tensor exp(const Tensor& t) {
  auto s = call("aten::exp", "", t);
  return first(s);
}

Tensor logaddexp(const Tensor& a, const Tensor& b) {
  auto s = call("aten::logaddexp", "", a, b);
  return first(s);
}

Tensor sum_dim(const Tensor& t, int64_t dim, ScalarType dtype) {
  const std::vector<int64_t> d{dim};
  return torch::stable::sum(t, IntHeaderOnlyArrayRef(d), false, dtype);
}

void sum_dim_out(const Tensor& out, const Tensor& t, int64_t dim, ScalarType dtype) {
  const std::vector<int64_t> d{dim};
  Tensor o = out;
  torch::stable::sum_out(o, t, IntHeaderOnlyArrayRef(d), false, dtype);
}

Tensor masked_fill(const Tensor& t, const Tensor& mask, double value) {
  // where(), not masked_fill.Tensor: the latter reads its value back with
  // .item() (a device-to-host copy and a wait on a GPU), and a CPU value
  // would be copied to the device with a wait; where() broadcasts a 0-d
  // device tensor, filled on the device.
  auto s = call("aten::where", "self", mask, scalar(value, t), t);
  return first(s);
}

Tensor ge(const Tensor& a, const Tensor& b) {
  auto s = call("aten::ge", "Tensor", a, b);
  return first(s);
}

Tensor le(const Tensor& a, const Tensor& b) {
  auto s = call("aten::le", "Tensor", a, b);
  return first(s);
}

Tensor eq(const Tensor& a, const Tensor& b) {
  auto s = call("aten::eq", "Tensor", a, b);
  return first(s);
}

Tensor logical_and(const Tensor& a, const Tensor& b) {
  auto s = call("aten::logical_and", "", a, b);
  return first(s);
}

Tensor logical_not(const Tensor& t) {
  auto s = call("aten::logical_not", "", t);
  return first(s);
}

Tensor any_dim(const Tensor& t, int64_t dim) {
  auto s = call("aten::any", "dim", t, dim, false);
  return first(s);
}

Tensor where_scalars(const Tensor& cond, double a, double b, const Opts& o) {
  const Tensor ta = full({}, a, o), tb = full({}, b, o);
  auto s = call("aten::where", "self", cond, ta, tb);
  return first(s);
}

Tensor pad_last(const Tensor& t, int64_t d) {
  const int64_t last = t.dim() - 1;
  if (t.size(last) == d) return t;
  // Zeros and a copy, not aten::pad: pad takes its mode as a string, and
  // torch 2.11-2.14 leak every string passed into the dispatcher (box.h).
  std::vector<int64_t> sizes = sizes_of(t);
  sizes[last] = d;
  Tensor out = zeros(sizes, opts_of(t));
  copy_(narrow(out, last, 0, t.size(last)), t);
  return out;
}

}  // namespace cplib::aten
