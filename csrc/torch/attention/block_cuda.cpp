// Block attention on CUDA: flash, efficient or cuDNN through ATen, chosen as
// scaled_dot_product_attention would (so torch.nn.attention.sdpa_kernel is
// honoured) unless the caller names one. Dropout is never used, so the
// backward kernels get placeholder philox tensors.
// Compiled into every build: no CUDA runtime call here, and the CPU build's
// guard (ring/cuda_glue_probe.cpp) runs these functions on meta tensors.

#include "attention/block.h"
#include "attention/cuda_tiles.h"
#include "attention/kernels.h"
#include "common/aten.h"

namespace cplib::attention {
namespace {

int64_t pick_backend(const BlockConfig& cfg) {
  // Resolved before the first block: by check_local_args, or by the ring
  // before its first exchange, alike on every rank (resolve_ring_backend).
  CPLIB_ASSERT(cfg.backend != kBackendAuto);
  return cfg.backend;
}

// cuDNN's frontend refuses the backward of a block with one query row and one
// key: "cuDNN Frontend error: s_q = s_kv = 1 is not supported." (its SDPA
// backward node's validation, reached from build_graph_backward in ATen's
// cudnn/MHA.cpp). Ragged ("any length") sequences give such blocks. Its
// forward serves them, and blocks with only one of the two lengths 1 run both
// ways (an H200 with torch 2.11.0+cu130, cuDNN 9.19). So only the backward of
// a 1x1 block leaves cuDNN, for the memory-efficient kernel: the backward is
// given the merged out and lse, so it needs nothing from the kernel that ran
// the forward.
bool cudnn_refuses_backward(int64_t q_len, int64_t kv_len) { return q_len == 1 && kv_len == 1; }

int64_t pick_backward_backend(const BlockConfig& cfg, int64_t q_len, int64_t kv_len) {
  const int64_t backend = pick_backend(cfg);
  if (backend == kBackendCudnn && cudnn_refuses_backward(q_len, kv_len)) return kBackendEfficient;
  return backend;
}

}  // namespace

BlockResult block_forward_cuda(const BlockConfig& cfg, const Tensor& q, const Tensor& k,
                               const Tensor& v, bool causal) {
  const int64_t Lq = q.size(2);
  switch (pick_backend(cfg)) {
    case kBackendFlash: {
      auto [out, lse] = flash_cuda(q, k, v, causal, cfg.scale);
      return {out, lse};
    }
    case kBackendEfficient: {
      auto [out, lse] = efficient_cuda(q, k, v, std::nullopt, causal, cfg.scale);
      return {out, aten::narrow(lse, 2, 0, Lq)};
    }
    default: {
      auto [out, lse] = cudnn_cuda(q, k, v, causal, cfg.scale);
      // (B,H,L,1) -> (B,H,L)
      return {out, lse.dim() == 4 ? torch::stable::squeeze(lse, -1) : lse};
    }
  }
}

std::tuple<Tensor, Tensor, Tensor> block_backward_cuda(const BlockConfig& cfg,
                                                       const Tensor& grad_out, const Tensor& q,
                                                       const Tensor& k, const Tensor& v,
                                                       const Tensor& out, const Tensor& lse,
                                                       bool causal) {
  const int64_t Lq = q.size(2), Lk = k.size(2);
  const Tensor seed = philox_placeholder(q), offset = philox_placeholder(q);
  switch (pick_backward_backend(cfg, Lq, Lk)) {
    case kBackendFlash:
      // Strided lse rows give wrong gradients in these kernels (upstream's note).
      return flash_cuda_backward(aten::contiguous(grad_out), q, k, v, aten::contiguous(out),
                                 aten::contiguous(lse), Lq, Lk, causal, seed, offset, cfg.scale);
    case kBackendEfficient:
      // The CUTLASS backward never reads out's row stride: it assumes the
      // (B, L, H, D)-dense memory its own forward returns (o_strideM() =
      // num_heads * head_dim in kernel_backward.h) when the f16/bf16 kernels
      // compute delta = rowsum(dO * O). A (B, H, L, D)-contiguous `out` was
      // read at the wrong rows and past its end: NaN or wrong dq/dk (dv, which
      // needs no delta, stayed right).
      return efficient_cuda_backward(seq_major(grad_out), q, k, v, Tensor(), seq_major(out),
                                     efficient_lse_padded(lse), seed, offset, causal, cfg.scale);
    default:
      return cudnn_cuda_backward(aten::contiguous(grad_out), q, k, v, aten::contiguous(out),
                                 aten::contiguous(torch::stable::unsqueeze(lse, -1)), seed, offset,
                                 Lq, Lk, causal, cfg.scale);
  }
}

}  // namespace cplib::attention
