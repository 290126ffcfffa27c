// One block of attention (q rows against one k/v block, heads already
// expanded to q's) through ATen's fused kernels that also return the
// log-sum-exp; the device picks the implementation.
#pragma once

#include <tuple>

#include "common/stable.h"

#include "ring/ring.h"

// Internal to the extension (torch's stable types are hidden).
#pragma GCC visibility push(hidden)

namespace cplib::ring {

struct BlockResult {
  Tensor out;  // (B, H, Lq, Dv), q's dtype
  Tensor lse;  // (B, H, Lq), accumulator dtype, possibly strided
};

// `mask` (optional): an additive (Lq, Lk) mask in q's dtype (0 or -inf).
// Rows it hides entirely come back with an unspecified lse: callers fix them.
BlockResult block_forward(const Config& cfg, const Tensor& q, const Tensor& k,
                          const Tensor& v, bool causal, const Tensor& mask = Tensor());

// Gradients of the block given the merged (global) out and lse of these q rows.
std::tuple<Tensor, Tensor, Tensor> block_backward(
    const Config& cfg, const Tensor& grad_out, const Tensor& q, const Tensor& k,
    const Tensor& v, const Tensor& out, const Tensor& lse, bool causal,
    const Tensor& mask = Tensor());

BlockResult block_forward_cpu(const Config& cfg, const Tensor& q, const Tensor& k,
                              const Tensor& v, bool causal, const Tensor& mask);
std::tuple<Tensor, Tensor, Tensor> block_backward_cpu(
    const Config& cfg, const Tensor& grad_out, const Tensor& q, const Tensor& k,
    const Tensor& v, const Tensor& out, const Tensor& lse, bool causal,
    const Tensor& mask);

// The CUDA blocks: compiled into every build (block_forward/block_backward
// take them for cfg.cuda: CUDA tensors, or meta tensors in the guard,
// cuda_glue_probe.cpp).
// The backend of one block call: `backend` itself, or for auto the one
// scaled_dot_product_attention would pick for these shapes (so
// torch.nn.attention.sdpa_kernel is honoured). Raises NotImplementedError
// when only the math backend would do.
int64_t resolve_backend_cuda(int64_t backend, const Tensor& q, const Tensor& k,
                             const Tensor& v, bool causal, std::optional<double> scale);
// The same for blocks of the given sizes (q heads; k/v seen expanded), with
// `like`'s dtype and device: what the ring resolves from inputs every rank
// agrees on (ring_args.cpp: resolve_ring_backend).
struct BlockShape {
  int64_t batch = 1, heads = 1, q_len = 1, kv_len = 1, head_dim = 1, v_head_dim = 1;
};
int64_t resolve_backend_cuda(int64_t backend, const Tensor& like, const BlockShape& shape,
                             bool causal, std::optional<double> scale);
BlockResult block_forward_cuda(const Config& cfg, const Tensor& q, const Tensor& k,
                               const Tensor& v, bool causal);
std::tuple<Tensor, Tensor, Tensor> block_backward_cuda(
    const Config& cfg, const Tensor& grad_out, const Tensor& q, const Tensor& k,
    const Tensor& v, const Tensor& out, const Tensor& lse, bool causal);
// Blocks with an explicit mask (windows, documents): the memory-efficient
// kernel with the mask as its attention bias (ring_block_cuda_masked.cpp).
BlockResult block_forward_cuda_masked(const Config& cfg, const Tensor& q, const Tensor& k,
                                      const Tensor& v, const Tensor& mask);
std::tuple<Tensor, Tensor, Tensor> block_backward_cuda_masked(
    const Config& cfg, const Tensor& grad_out, const Tensor& q, const Tensor& k,
    const Tensor& v, const Tensor& out, const Tensor& lse, const Tensor& mask);

}  // namespace cplib::ring

#pragma GCC visibility pop
