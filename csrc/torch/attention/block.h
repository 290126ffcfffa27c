// One block of attention (q rows against one k/v block, heads already
// expanded to q's) through ATen's fused kernels that also return the
// log-sum-exp; the device picks the implementation. What the ring runs per
// step, Ulysses' local attention once per call and decode once per shard.
#pragma once

#include <array>
#include <optional>
#include <tuple>
#include <vector>

#include "attention/backend.h"
#include "common/stable.h"

// Internal to the extension (torch's stable types are hidden).
#pragma GCC visibility push(hidden)

namespace cplib::attention {

// How every block of one call runs, checked once (check_local_args,
// checks.h); the ring's Config extends it (ring/ring.h).
struct BlockConfig {
  bool causal = false;
  // nullopt: SDPA's default, 1/sqrt(q's head dim); fixed to that when v's
  // head dim differs (MLA: some kernels see zero-padded q/k).
  std::optional<double> scale;
  int64_t backend = kBackendAuto;  // resolved before the first CUDA block
  int64_t groups = 1;              // q heads per k/v head (GQA)
  // The CUDA block kernels (block_cuda*.cpp): q on a CUDA device, or meta
  // tensors in the guard (ring/cuda_glue_probe.cpp).
  bool cuda = false;
  // The call's visibility is one that scaled_dot_product_attention would be
  // given as an attn_mask (documents, a window, explicit positions), whatever
  // each block of it needs: decides the blocks' precision (block.cpp).
  bool masked_call = false;
};

struct BlockResult {
  Tensor out;  // (B, H, Lq, Dv), q's dtype
  Tensor lse;  // (B, H, Lq), accumulator dtype, possibly strided
};

// The accumulator dtype: float64 for float64 inputs, else float32.
inline ScalarType acc_dtype(const Tensor& t) {
  return t.scalar_type() == ScalarType::Double ? ScalarType::Double : ScalarType::Float;
}

// `mask` (optional): an additive (Lq, Lk) mask in q's dtype (0 or -inf).
// Rows it hides entirely come back with an unspecified lse: callers fix them.
BlockResult block_forward(const BlockConfig& cfg, const Tensor& q, const Tensor& k, const Tensor& v,
                          bool causal, const Tensor& mask = Tensor());

// Gradients of the block given the merged (global) out and lse of these q rows.
std::tuple<Tensor, Tensor, Tensor> block_backward(const BlockConfig& cfg, const Tensor& grad_out,
                                                  const Tensor& q, const Tensor& k, const Tensor& v,
                                                  const Tensor& out, const Tensor& lse, bool causal,
                                                  const Tensor& mask = Tensor());

// Whether block_forward(cfg, q, k, v, causal) without a mask runs cuDNN's
// forward (CUDA, cuDNN resolved, no fp32 promotion): such blocks of one ring
// step may run in one call.
bool forwards_on_cudnn(const BlockConfig& cfg, const Tensor& q, const Tensor& v);
// Those blocks' forwards (q, k, v per block, k/v expanded), each what
// block_forward gives (MLA's head dims padded at the call alike), in one
// call of the Python op that reaches cuDNN (the stable dispatcher cannot
// return its SymInts): one Python round trip for a whole ring step.
std::vector<BlockResult> block_forward_cudnn_step(const BlockConfig& cfg,
                                                  const std::vector<std::array<Tensor, 3>>& qkv,
                                                  const std::vector<int64_t>& causal);

// The kernels block_forward/block_backward pick by device (block.cpp). The
// CUDA ones are compiled into every build: they take cfg.cuda, CUDA
// tensors, or meta tensors in the guard (ring/cuda_glue_probe.cpp).
BlockResult block_forward_cpu(const BlockConfig& cfg, const Tensor& q, const Tensor& k,
                              const Tensor& v, bool causal, const Tensor& mask);
std::tuple<Tensor, Tensor, Tensor> block_backward_cpu(const BlockConfig& cfg,
                                                      const Tensor& grad_out, const Tensor& q,
                                                      const Tensor& k, const Tensor& v,
                                                      const Tensor& out, const Tensor& lse,
                                                      bool causal, const Tensor& mask);
BlockResult block_forward_cuda(const BlockConfig& cfg, const Tensor& q, const Tensor& k,
                               const Tensor& v, bool causal);
std::tuple<Tensor, Tensor, Tensor> block_backward_cuda(const BlockConfig& cfg,
                                                       const Tensor& grad_out, const Tensor& q,
                                                       const Tensor& k, const Tensor& v,
                                                       const Tensor& out, const Tensor& lse,
                                                       bool causal);
// Blocks with an explicit mask (windows, documents): the memory-efficient
// kernel with the mask as its attention bias (block_cuda_masked.cpp).
BlockResult block_forward_cuda_masked(const BlockConfig& cfg, const Tensor& q, const Tensor& k,
                                      const Tensor& v, const Tensor& mask);
std::tuple<Tensor, Tensor, Tensor> block_backward_cuda_masked(
    const BlockConfig& cfg, const Tensor& grad_out, const Tensor& q, const Tensor& k,
    const Tensor& v, const Tensor& out, const Tensor& lse, const Tensor& mask);

}  // namespace cplib::attention

#pragma GCC visibility pop
