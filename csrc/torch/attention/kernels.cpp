#include "attention/kernels.h"

#include <algorithm>
#include <cmath>
#include <iterator>

#include "common/aten.h"

namespace cplib::attention {

using aten::narrow;
using aten::pad_last;

std::tuple<Tensor, Tensor> flash_cpu(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                                     const std::optional<Tensor>& mask,
                                     std::optional<double> scale) {
  auto s = call<2>("aten::_scaled_dot_product_flash_attention_for_cpu", "", q, k, v, 0.0, causal,
                   mask, scale);
  Tensor out = ret<Tensor>(s[0]), lse = ret<Tensor>(s[1]);
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor> flash_cpu_backward(const Tensor& grad_out, const Tensor& q,
                                                      const Tensor& k, const Tensor& v,
                                                      const Tensor& out, const Tensor& lse,
                                                      bool causal,
                                                      const std::optional<Tensor>& mask,
                                                      std::optional<double> scale) {
  auto s = call<3>("aten::_scaled_dot_product_flash_attention_for_cpu_backward", "", grad_out, q, k,
                   v, out, lse, 0.0, causal, mask, scale);
  Tensor gq = ret<Tensor>(s[0]), gk = ret<Tensor>(s[1]), gv = ret<Tensor>(s[2]);
  return {gq, gk, gv};
}

int64_t fused_sdp_choice(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                         std::optional<double> scale) {
  auto s = call("aten::_fused_sdp_choice", "", q, k, v, std::optional<Tensor>(), 0.0, causal, scale,
                false);
  return ret<int64_t>(s[0]);
}

namespace {

// The arguments of aten::_flash_attention_forward that cplib fills, by name.
// The call passes exactly the running torch's list, in its order (15 on
// torch 2.11, 17 from 2.13 on: block_table and num_splits): the stable
// dispatcher call reads as many slots as the running schema has. (Packed
// as written, the enum and its names side by side: not clang-format's one
// line per name.)
// clang-format off
enum class FlashArg {
  query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
  return_debug_mask, scale, window_size_left, window_size_right, seqused_k, alibi_slopes,
  block_table, num_splits
};
constexpr const char* kFlashArgNames[] = {
    "query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p",
    "is_causal", "return_debug_mask", "scale", "window_size_left", "window_size_right",
    "seqused_k", "alibi_slopes", "block_table", "num_splits"};
// clang-format on
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
      CPLIB_CHECK_NOT_IMPLEMENTED(it != end,
                                  "cplib: this torch's aten::_flash_attention_forward "
                                  "takes an argument '",
                                  name, "' that cplib does not know");
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

// The memory-efficient kernels need every row stride 16-byte aligned ("query
// is not correctly aligned (strideM)" for a bf16 head dim of 36, seen on an
// H200): q/k/v head dims are zero-padded up to that, as for flash, only where
// needed (fp32's multiple of 4 is).
int64_t efficient_head_dim(const Tensor& q, const Tensor& v) {
  const int64_t per_16_bytes = q.scalar_type() == ScalarType::Float ? 4 : 8;
  if (q.size(3) % per_16_bytes == 0 && v.size(3) % per_16_bytes == 0) return -1;
  return round_up(std::max(q.size(3), v.size(3)), per_16_bytes);
}

Tensor cut_last(const Tensor& t, int64_t d) { return t.size(3) == d ? t : narrow(t, 3, 0, d); }

// `t` (B, H, L, D) zero-padded to head dim d in one copy, its memory
// (B, L, H, d)-dense: what seq_major(pad_last(t, d)) gives, without the
// intermediate (B, H, L, d) copy.
Tensor pad_last_seq_major(const Tensor& t, int64_t d) {
  Tensor dense = aten::zeros({t.size(0), t.size(2), t.size(1), d}, aten::opts_of(t));
  Tensor view = torch::stable::transpose(dense, 1, 2);
  aten::copy_(narrow(view, 3, 0, t.size(3)), t);
  return view;
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
  check_dispatch(
      torch_call_dispatcher("aten::_flash_attention_forward", "", stack.data(), TORCH_ABI_VERSION),
      "aten::_flash_attention_forward", "");
  Tensor out = ret<Tensor>(stack[0]), lse = ret<Tensor>(stack[1]);
  // rng state, unused, debug mask: released.
  for (const int i : {2, 3, 4}) (void)ret<Tensor>(stack[i]);
  out = torch::stable::transpose(out, 1, 2);
  return {out.size(3) == dv ? out : narrow(out, 3, 0, dv), lse};
}

std::tuple<Tensor, Tensor, Tensor> flash_cuda_backward(const Tensor& grad_out, const Tensor& q,
                                                       const Tensor& k, const Tensor& v,
                                                       const Tensor& out, const Tensor& lse,
                                                       int64_t max_q, int64_t max_k, bool causal,
                                                       const Tensor& seed, const Tensor& offset,
                                                       std::optional<double> scale) {
  // Padded as the forward was (zero columns of out and grad_out change
  // nothing: the padded v columns are zero).
  const int64_t d = flash_head_dim(q, v);
  const std::optional<double> sc = scale_or_default(scale, q);
  auto s = call<3>("aten::_scaled_dot_product_flash_attention_backward", "", pad_last(grad_out, d),
                   pad_last(q, d), pad_last(k, d), pad_last(v, d), pad_last(out, d), lse, Tensor(),
                   Tensor(), max_q, max_k, 0.0, causal, seed, offset, sc);
  Tensor gq = ret<Tensor>(s[0]), gk = ret<Tensor>(s[1]), gv = ret<Tensor>(s[2]);
  auto cut = [](const Tensor& g, int64_t dim) {
    return g.size(3) == dim ? g : narrow(g, 3, 0, dim);
  };
  return {cut(gq, q.size(3)), cut(gk, k.size(3)), cut(gv, v.size(3))};
}

std::tuple<Tensor, Tensor> efficient_cuda(const Tensor& q, const Tensor& k, const Tensor& v,
                                          const std::optional<Tensor>& bias, bool causal,
                                          std::optional<double> scale) {
  const int64_t d = efficient_head_dim(q, v);
  if (d > 0) {  // padded: the real scale, and out cut back to v's head dim
    auto [out, lse] = efficient_cuda(pad_last(q, d), pad_last(k, d), pad_last(v, d), bias, causal,
                                     scale_or_default(scale, q));
    return {cut_last(out, v.size(3)), lse};
  }
  auto s = call<4>("aten::_scaled_dot_product_efficient_attention", "", q, k, v, bias, true, 0.0,
                   causal, scale);
  Tensor out = ret<Tensor>(s[0]), lse = ret<Tensor>(s[1]);
  (void)ret<Tensor>(s[2]);
  (void)ret<Tensor>(s[3]);
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor> efficient_cuda_backward(const Tensor& grad_out, const Tensor& q,
                                                           const Tensor& k, const Tensor& v,
                                                           const Tensor& bias, const Tensor& out,
                                                           const Tensor& lse, const Tensor& seed,
                                                           const Tensor& offset, bool causal,
                                                           std::optional<double> scale) {
  const int64_t d = efficient_head_dim(q, v);
  if (d > 0) {
    // Padded as the forward was; out and grad_out stay (B, L, H, D)-dense
    // (see block_cuda.cpp), their zero columns add nothing to delta.
    auto [gq, gk, gv] = efficient_cuda_backward(
        pad_last_seq_major(grad_out, d), pad_last(q, d), pad_last(k, d), pad_last(v, d), bias,
        pad_last_seq_major(out, d), lse, seed, offset, causal, scale_or_default(scale, q));
    return {cut_last(gq, q.size(3)), cut_last(gk, k.size(3)), cut_last(gv, v.size(3))};
  }
  bool grad_mask[4] = {true, true, true, false};
  auto s = call<4>("aten::_scaled_dot_product_efficient_attention_backward", "", grad_out, q, k, v,
                   bias, out, lse, seed, offset, 0.0,
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

std::vector<std::pair<Tensor, Tensor>> cudnn_cuda_step(const std::vector<Tensor>& q,
                                                       const std::vector<Tensor>& k,
                                                       const std::vector<Tensor>& v,
                                                       const std::vector<int64_t>& causal,
                                                       std::optional<double> scale) {
  auto s = call<2>("cplib_c::_cudnn_attention_step", "", q, k, v, causal, scale);
  std::vector<Tensor> out = ret<std::vector<Tensor>>(s[0]), lse = ret<std::vector<Tensor>>(s[1]);
  CPLIB_ASSERT(out.size() == q.size() && lse.size() == q.size());
  std::vector<std::pair<Tensor, Tensor>> results;
  for (size_t i = 0; i < out.size(); ++i) results.emplace_back(out[i], lse[i]);
  return results;
}

std::tuple<Tensor, Tensor, Tensor> cudnn_cuda_backward(const Tensor& grad_out, const Tensor& q,
                                                       const Tensor& k, const Tensor& v,
                                                       const Tensor& out, const Tensor& lse,
                                                       const Tensor& seed, const Tensor& offset,
                                                       int64_t max_q, int64_t max_k, bool causal,
                                                       std::optional<double> scale) {
  auto s = call<3>("aten::_scaled_dot_product_cudnn_attention_backward", "", grad_out, q, k, v, out,
                   lse, seed, offset, Tensor(), Tensor(), Tensor(), max_q, max_k, 0.0, causal,
                   scale);
  Tensor gq = ret<Tensor>(s[0]), gk = ret<Tensor>(s[1]), gv = ret<Tensor>(s[2]);
  return {gq, gk, gv};
}

STABLE_TORCH_LIBRARY_FRAGMENT(cplib_c, m) {
  // The argument names cplib passes to aten::_flash_attention_forward, in
  // order (the running torch's schema; tests/comm/test_cuda_glue.py compares them).
  m.def("_flash_forward_arguments() -> str[]");
}

STABLE_TORCH_LIBRARY_IMPL(cplib_c, CompositeExplicitAutograd, m) {
  m.impl("_flash_forward_arguments", CPLIB_BOX(&flash_forward_argument_names));
}

}  // namespace cplib::attention
