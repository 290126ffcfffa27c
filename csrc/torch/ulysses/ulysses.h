// Ulysses (all-to-all head parallelism): re-sharding (B, H, S, D) tensors
// between the sequence and the head dimension over a process group, and the
// full-sequence attention each rank runs on its heads.
//
// Layouts (N = group size, R = head_repeat):
//   sequence shard  (B, H, S/N, D)      rank r holds rows [r S/N, (r+1) S/N)
//   head shard      (B, H R/N, S, D)    rank r holds heads [r H R/N, (r+1) H R/N)
//                                       of the heads repeated R times each
//                                       (GQA: R > 1 only to reach one head per
//                                       rank, H R == N).
// seq -> heads returns a sequence-major tensor (strides of (S, B, H, D)), and
// heads -> seq a head-major one (strides of (H, B, S, D)): exactly the orders
// in which the chunks arrive from the other ranks, so the exchange's output
// is the result as it stands and the only copy is the packing of the send buffer.
#pragma once

#include <optional>
#include <string_view>
#include <tuple>
#include <vector>

#include "common/stable.h"

namespace cplib::ulysses {

// `lengths` (empty: S/N each): every rank's sequence length, for ranks of
// different lengths (non-causal attention only). Without `handshake`: a call
// that another op's handshake covers (a backward through autograd, the
// exchanges back inside ulysses_sdpa), which makes none of its own.
Tensor reshard(const Tensor& x, std::string_view group_name, bool to_heads, int64_t head_repeat,
               const std::vector<int64_t>& lengths = {}, bool handshake = true);

// Several re-shards in one direction (q, k, v; or their gradients), all in
// flight at once, every input checked before any exchange starts.
std::vector<Tensor> reshard_many(const std::vector<Tensor>& xs, std::string_view group_name,
                                 bool to_heads, const std::vector<int64_t>& head_repeats,
                                 const std::vector<int64_t>& lengths = {}, bool handshake = true);

// Full-sequence attention of head-sharded q, k, v (k/v may have fewer heads:
// GQA; v's head dim may differ: MLA). out is sequence-major (strides of
// (S, B, H, D)), lse (B, H, S) contiguous in the accumulator dtype, as
// ring_sdpa's; `sinks` (one logit per local q head) join the softmax.
std::tuple<Tensor, Tensor> local_sdpa(const Tensor& q, const Tensor& k, const Tensor& v,
                                      bool is_causal, std::optional<double> scale, int64_t backend,
                                      const Tensor& sinks = {});

// dq, dk, dv with the strides of a (B, S, H, D) tensor.
std::tuple<Tensor, Tensor, Tensor> local_sdpa_backward(const Tensor& grad_out, const Tensor& q,
                                                       const Tensor& k, const Tensor& v,
                                                       const Tensor& out, const Tensor& lse,
                                                       bool is_causal, std::optional<double> scale,
                                                       int64_t backend);

// Bytes this process has sent in Ulysses exchanges since the last reset (a
// debug counter for tests and benchmarks).
int64_t bytes_sent(bool reset);

}  // namespace cplib::ulysses
