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
  CPLIB_CHECK_VALUE(sizes.size() == strides.size() && offset >= 0,
                    "cplib: internal view with ", sizes.size(), " sizes, ", strides.size(),
                    " strides and offset ", offset);
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
  for (size_t i = sizes.size(); i-- > 1;) strides[i - 1] = strides[i] * std::max<int64_t>(sizes[i], 1);
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
  if (t.size(3) == d) return t;
  const std::vector<int64_t> p{0, d - t.size(3)};
  return torch::stable::pad(t, p, "constant", 0.0);
}

std::tuple<Tensor, Tensor> flash_cpu(const Tensor& q, const Tensor& k, const Tensor& v,
                                     bool causal, const std::optional<Tensor>& mask,
                                     std::optional<double> scale) {
  auto s = call<2>("aten::_scaled_dot_product_flash_attention_for_cpu", "", q, k, v, 0.0, causal,
                   mask, scale);
  Tensor out = ret<Tensor>(s[0]), lse = ret<Tensor>(s[1]);
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor> flash_cpu_backward(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
    const Tensor& lse, bool causal, const std::optional<Tensor>& mask,
    std::optional<double> scale) {
  auto s = call<3>("aten::_scaled_dot_product_flash_attention_for_cpu_backward", "", grad_out, q,
                   k, v, out, lse, 0.0, causal, mask, scale);
  Tensor gq = ret<Tensor>(s[0]), gk = ret<Tensor>(s[1]), gv = ret<Tensor>(s[2]);
  return {gq, gk, gv};
}

int64_t fused_sdp_choice(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                         std::optional<double> scale) {
  auto s = call("aten::_fused_sdp_choice", "", q, k, v, std::optional<Tensor>(), 0.0, causal,
                scale, false);
  return ret<int64_t>(s[0]);
}

namespace {

// The arguments of aten::_flash_attention_forward that cplib fills, by name.
// The call passes exactly the running torch's list, in its order (15 on
// torch 2.11, 17 from 2.13 on: block_table and num_splits): the stable
// dispatcher call reads as many slots as the running schema has.
enum class FlashArg {
  query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
  return_debug_mask, scale, window_size_left, window_size_right, seqused_k, alibi_slopes,
  block_table, num_splits
};
constexpr const char* kFlashArgNames[] = {
    "query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p",
    "is_causal", "return_debug_mask", "scale", "window_size_left", "window_size_right",
    "seqused_k", "alibi_slopes", "block_table", "num_splits"};
constexpr size_t kFlashReturns = 5;

// The running torch's argument list, asked once (cplib_c::_schema_arguments,
// cplib/comm/cuda_attention.py); a name cplib does not know raises
// NotImplementedError naming it (and is asked again at the next call).
const std::vector<FlashArg>& flash_forward_order() {
  static const std::vector<FlashArg> order = [] {
    auto s = call("cplib_c::_schema_arguments", "", std::string("aten::_flash_attention_forward"),
                  std::string(""));
    std::vector<FlashArg> out;
    for (const std::string& name : ret<std::vector<std::string>>(s[0])) {
      const auto* end = std::end(kFlashArgNames);
      const auto* it = std::find(std::begin(kFlashArgNames), end, name);
      CPLIB_CHECK_NOT_IMPLEMENTED(it != end, "cplib: this torch's aten::_flash_attention_forward "
                                  "takes an argument '", name, "' that cplib does not know");
      out.push_back(static_cast<FlashArg>(it - std::begin(kFlashArgNames)));
    }
    return out;
  }();
  return order;
}

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// SDPA pads q/k/v head dims up to a multiple of 8 before it calls flash
// (which rejects others) and scales by the real head dim; so does cplib, at
// the kernel call only. The common padded head dim of q, k and v.
int64_t flash_head_dim(const Tensor& q, const Tensor& v) {
  return round_up(std::max(q.size(3), v.size(3)), 8);
}

double scale_or_default(std::optional<double> scale, const Tensor& q) {
  return scale ? *scale : 1.0 / std::sqrt(static_cast<double>(q.size(3)));
}

}  // namespace

std::vector<std::string> flash_forward_argument_names() {
  std::vector<std::string> names;
  for (const FlashArg a : flash_forward_order())
    names.emplace_back(kFlashArgNames[static_cast<size_t>(a)]);
  return names;
}

std::tuple<Tensor, Tensor> flash_cuda(const Tensor& q, const Tensor& k, const Tensor& v,
                                      bool causal, std::optional<double> scale) {
  // _flash_attention_forward, not _scaled_dot_product_flash_attention: the
  // latter returns max_q/max_k as SymInts, which the stable call cannot
  // convert. Its layout is (B, L, H, D): transposed views in and out, as
  // SDPA's own flash path does.
  const int64_t d = flash_head_dim(q, v), dv = v.size(3);
  const std::optional<double> sc = scale_or_default(scale, q);
  const Tensor qt = torch::stable::transpose(pad_last(q, d), 1, 2);
  const Tensor kt = torch::stable::transpose(pad_last(k, d), 1, 2);
  const Tensor vt = torch::stable::transpose(pad_last(v, d), 1, 2);
  const std::optional<int64_t> no_int;
  const std::optional<Tensor> no_tensor;
  const std::vector<FlashArg>& order = flash_forward_order();
  std::vector<StableIValue> stack(std::max(order.size(), kFlashReturns));
  for (size_t i = 0; i < order.size(); ++i) {
    using torch::stable::detail::from;
    switch (order[i]) {
      case FlashArg::query: stack[i] = from(qt); break;
      case FlashArg::key: stack[i] = from(kt); break;
      case FlashArg::value: stack[i] = from(vt); break;
      case FlashArg::max_q: stack[i] = from(q.size(2)); break;
      case FlashArg::max_k: stack[i] = from(k.size(2)); break;
      case FlashArg::dropout_p: stack[i] = from(0.0); break;
      case FlashArg::is_causal: stack[i] = from(causal); break;
      case FlashArg::return_debug_mask: stack[i] = from(false); break;
      case FlashArg::scale: stack[i] = from(sc); break;
      case FlashArg::window_size_left:
      case FlashArg::window_size_right:
      case FlashArg::num_splits: stack[i] = from(no_int); break;
      default: stack[i] = from(no_tensor); break;  // the optional tensors: None
    }
  }
  check_dispatch(torch_call_dispatcher("aten::_flash_attention_forward", "", stack.data(),
                                       TORCH_ABI_VERSION),
                 "aten::_flash_attention_forward", "");
  Tensor out = ret<Tensor>(stack[0]), lse = ret<Tensor>(stack[1]);
  // rng state, unused, debug mask: released.
  for (const int i : {2, 3, 4}) (void)ret<Tensor>(stack[i]);
  out = torch::stable::transpose(out, 1, 2);
  return {out.size(3) == dv ? out : narrow(out, 3, 0, dv), lse};
}

std::tuple<Tensor, Tensor, Tensor> flash_cuda_backward(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
    const Tensor& lse, int64_t max_q, int64_t max_k, bool causal, const Tensor& seed,
    const Tensor& offset, std::optional<double> scale) {
  // Padded as the forward was (zero columns of out and grad_out change
  // nothing: the padded v columns are zero).
  const int64_t d = flash_head_dim(q, v);
  const std::optional<double> sc = scale_or_default(scale, q);
  auto s = call<3>("aten::_scaled_dot_product_flash_attention_backward", "",
                   pad_last(grad_out, d), pad_last(q, d), pad_last(k, d), pad_last(v, d),
                   pad_last(out, d), lse, Tensor(), Tensor(), max_q, max_k, 0.0, causal, seed,
                   offset, sc);
  Tensor gq = ret<Tensor>(s[0]), gk = ret<Tensor>(s[1]), gv = ret<Tensor>(s[2]);
  auto cut = [](const Tensor& g, int64_t dim) { return g.size(3) == dim ? g : narrow(g, 3, 0, dim); };
  return {cut(gq, q.size(3)), cut(gk, k.size(3)), cut(gv, v.size(3))};
}

std::tuple<Tensor, Tensor> efficient_cuda(const Tensor& q, const Tensor& k, const Tensor& v,
                                          const std::optional<Tensor>& bias, bool causal,
                                          std::optional<double> scale) {
  auto s = call<4>("aten::_scaled_dot_product_efficient_attention", "", q, k, v, bias, true, 0.0,
                   causal, scale);
  Tensor out = ret<Tensor>(s[0]), lse = ret<Tensor>(s[1]);
  (void)ret<Tensor>(s[2]);
  (void)ret<Tensor>(s[3]);
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor> efficient_cuda_backward(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& bias,
    const Tensor& out, const Tensor& lse, const Tensor& seed, const Tensor& offset, bool causal,
    std::optional<double> scale) {
  bool grad_mask[4] = {true, true, true, false};
  auto s = call<4>("aten::_scaled_dot_product_efficient_attention_backward", "", grad_out, q, k,
                   v, bias, out, lse, seed, offset, 0.0,
                   torch::headeronly::HeaderOnlyArrayRef<bool>(grad_mask, 4), causal, scale);
  Tensor gq = ret<Tensor>(s[0]), gk = ret<Tensor>(s[1]), gv = ret<Tensor>(s[2]);
  (void)ret<Tensor>(s[3]);
  return {gq, gk, gv};
}

std::tuple<Tensor, Tensor> cudnn_cuda(const Tensor& q, const Tensor& k, const Tensor& v,
                                      bool causal, std::optional<double> scale) {
  // Both of ATen's cuDNN forward ops return SymInts (max_q, max_k), which the
  // stable call cannot convert: a Python op calls the ATen op and returns its
  // tensors only (one Python round trip per call).
  auto s = call<2>("cplib_c::_cudnn_attention", "", q, k, v, causal, scale);
  Tensor out = ret<Tensor>(s[0]), lse = ret<Tensor>(s[1]);
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor> cudnn_cuda_backward(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
    const Tensor& lse, const Tensor& seed, const Tensor& offset, int64_t max_q, int64_t max_k,
    bool causal, std::optional<double> scale) {
  auto s = call<3>("aten::_scaled_dot_product_cudnn_attention_backward", "", grad_out, q, k, v,
                   out, lse, seed, offset, Tensor(), Tensor(), Tensor(), max_q, max_k, 0.0,
                   causal, scale);
  Tensor gq = ret<Tensor>(s[0]), gk = ret<Tensor>(s[1]), gv = ret<Tensor>(s[2]);
  return {gq, gk, gv};
}

}  // namespace cplib::aten
