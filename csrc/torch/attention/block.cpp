// Block attention on CPU: ATen's flash kernel for CPU (lse is (B,H,L) in
// float32, float64 for float64 inputs, and strided); and block_forward /
// block_backward, which pick the CPU or the CUDA kernels (cfg.cuda) and pad
// MLA's head dims where a kernel needs one.
#include <algorithm>

#include "attention/block.h"
#include "attention/kernels.h"
#include "common/aten.h"

namespace cplib::attention {
namespace {

std::optional<Tensor> optional(const Tensor& t) {
  return t.defined() ? std::optional<Tensor>(t) : std::nullopt;
}

}  // namespace

BlockResult block_forward_cpu(const BlockConfig& cfg, const Tensor& q, const Tensor& k,
                              const Tensor& v, bool causal, const Tensor& mask) {
  auto [out, lse] = flash_cpu(q, k, v, causal, optional(mask), cfg.scale);
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor> block_backward_cpu(const BlockConfig& cfg,
                                                      const Tensor& grad_out, const Tensor& q,
                                                      const Tensor& k, const Tensor& v,
                                                      const Tensor& out, const Tensor& lse,
                                                      bool causal, const Tensor& mask) {
  return flash_cpu_backward(grad_out, q, k, v, out, lse, causal, optional(mask), cfg.scale);
}

namespace {

// MLA: v's head dim may differ from q/k's. The kernels other than CUDA's
// efficient one need a single head dim, so the narrower side is zero-padded
// at the call (exact: zero q/k columns add nothing to the scores, zero v
// columns give zero output columns) and the results are sliced back. The
// scale was fixed from q's head dim in check_local_args.
bool pads(const BlockConfig& cfg, const Tensor& q, const Tensor& v, bool masked) {
  if (q.size(3) == v.size(3)) return false;
  if (!cfg.cuda) return true;
  return !masked && cfg.backend != kBackendEfficient;
}

// A masked fp16/bf16 call whose head dim is not a multiple of 8 (the
// efficient kernel's row alignment in half precision) is one no fused SDPA
// kernel takes (flash and cuDNN take no mask), so
// scaled_dot_product_attention computes it on its math path, in fp32. The
// ring's blocks of such a call, padded to a multiple of 8 and run in bf16,
// gave dq 1.6-2.2x that single-device error (head dim 36, an H200,
// 2026-11-28). Every block of it (its plain causal ones too) runs the
// efficient kernel in fp32 instead, rounded once at the end.
bool computes_in_fp32(const BlockConfig& cfg, const Tensor& q, const Tensor& v) {
  constexpr int64_t kHalfAlign = 8;
  return cfg.cuda && cfg.masked_call && q.scalar_type() != ScalarType::Float &&
         q.scalar_type() != ScalarType::Double &&
         (q.size(3) % kHalfAlign != 0 || v.size(3) % kHalfAlign != 0);
}

BlockConfig fp32_config(const BlockConfig& cfg) {
  BlockConfig c = cfg;
  c.backend = kBackendEfficient;
  c.masked_call = false;
  return c;
}

Tensor fp32(const Tensor& t) { return t.defined() ? aten::to(t, ScalarType::Float) : t; }

BlockResult forward_kernel(const BlockConfig& cfg, const Tensor& q, const Tensor& k,
                           const Tensor& v, bool causal, const Tensor& mask) {
  if (cfg.cuda && mask.defined()) return block_forward_cuda_masked(cfg, q, k, v, mask);
  if (cfg.cuda) return block_forward_cuda(cfg, q, k, v, causal);
  return block_forward_cpu(cfg, q, k, v, causal, mask);
}

std::tuple<Tensor, Tensor, Tensor> backward_kernel(const BlockConfig& cfg, const Tensor& grad_out,
                                                   const Tensor& q, const Tensor& k,
                                                   const Tensor& v, const Tensor& out,
                                                   const Tensor& lse, bool causal,
                                                   const Tensor& mask) {
  if (cfg.cuda && mask.defined())
    return block_backward_cuda_masked(cfg, grad_out, q, k, v, out, lse, mask);
  if (cfg.cuda) return block_backward_cuda(cfg, grad_out, q, k, v, out, lse, causal);
  return block_backward_cpu(cfg, grad_out, q, k, v, out, lse, causal, mask);
}

}  // namespace

bool forwards_on_cudnn(const BlockConfig& cfg, const Tensor& q, const Tensor& v) {
  return cfg.cuda && cfg.backend == kBackendCudnn && !computes_in_fp32(cfg, q, v);
}

std::vector<BlockResult> block_forward_cudnn_step(const BlockConfig& cfg,
                                                  const std::vector<std::array<Tensor, 3>>& qkv,
                                                  const std::vector<int64_t>& causal) {
  std::vector<Tensor> q, k, v;
  for (const auto& t : qkv) {
    // MLA: padded to one head dim at the call, as block_forward pads.
    const int64_t d = pads(cfg, t[0], t[2], false) ? std::max(t[0].size(3), t[2].size(3)) : 0;
    q.push_back(d ? aten::pad_last(t[0], d) : t[0]);
    k.push_back(d ? aten::pad_last(t[1], d) : t[1]);
    v.push_back(d ? aten::pad_last(t[2], d) : t[2]);
  }
  std::vector<std::pair<Tensor, Tensor>> ran = cudnn_cuda_step(q, k, v, causal, cfg.scale);
  std::vector<BlockResult> out;
  for (size_t i = 0; i < ran.size(); ++i) {
    const auto& [o, lse] = ran[i];
    const int64_t dv = qkv[i][2].size(3);
    out.push_back({o.size(3) == dv ? o : aten::narrow(o, 3, 0, dv),
                   lse.dim() == 4 ? torch::stable::squeeze(lse, -1) : lse});
  }
  return out;
}

BlockResult block_forward(const BlockConfig& cfg, const Tensor& q, const Tensor& k, const Tensor& v,
                          bool causal, const Tensor& mask) {
  if (computes_in_fp32(cfg, q, v)) {
    BlockResult r = block_forward(fp32_config(cfg), fp32(q), fp32(k), fp32(v), causal, fp32(mask));
    r.out = aten::to(r.out, q.scalar_type());
    return r;
  }
  if (!pads(cfg, q, v, mask.defined())) return forward_kernel(cfg, q, k, v, causal, mask);
  const int64_t d = std::max(q.size(3), v.size(3));
  BlockResult r = forward_kernel(cfg, aten::pad_last(q, d), aten::pad_last(k, d),
                                 aten::pad_last(v, d), causal, mask);
  r.out = aten::narrow(r.out, 3, 0, v.size(3));
  return r;
}

std::tuple<Tensor, Tensor, Tensor> block_backward(const BlockConfig& cfg, const Tensor& grad_out,
                                                  const Tensor& q, const Tensor& k, const Tensor& v,
                                                  const Tensor& out, const Tensor& lse, bool causal,
                                                  const Tensor& mask) {
  if (computes_in_fp32(cfg, q, v)) {
    auto [gq, gk, gv] = block_backward(fp32_config(cfg), fp32(grad_out), fp32(q), fp32(k), fp32(v),
                                       fp32(out), lse, causal, fp32(mask));
    return {aten::to(gq, q.scalar_type()), aten::to(gk, k.scalar_type()),
            aten::to(gv, v.scalar_type())};
  }
  if (!pads(cfg, q, v, mask.defined()))
    return backward_kernel(cfg, grad_out, q, k, v, out, lse, causal, mask);
  const int64_t d = std::max(q.size(3), v.size(3));
  auto [gq, gk, gv] = backward_kernel(cfg, aten::pad_last(grad_out, d), aten::pad_last(q, d),
                                      aten::pad_last(k, d), aten::pad_last(v, d),
                                      aten::pad_last(out, d), lse, causal, mask);
  return {aten::narrow(gq, 3, 0, q.size(3)), aten::narrow(gk, 3, 0, k.size(3)),
          aten::narrow(gv, 3, 0, v.size(3))};
}

}  // namespace cplib::attention
