// Halo exchange for tp_convolution: the neighbour messages (both sends and
// both receives in flight at once) and slab packing through the C core
// (csrc/core/halo.c, csrc/cuda/halo.cu).
#pragma once

#include <memory>
#include <vector>

#include <ATen/ATen.h>

#include "comm/comm.h"
#include "conv/tp_conv_plan.h"

namespace cplib {

// t[..., start:start+width, ...] along dim -> fresh contiguous tensor.
at::Tensor pack_slab(const at::Tensor& t, int64_t dim, int64_t start, int64_t width);
// Contiguous buf -> t[..., start:start+buf.size(dim), ...].
void unpack_slab(at::Tensor& t, int64_t dim, int64_t start, const at::Tensor& buf);

// Messages to and from the two neighbours, posted together on construction
// (one coalesced group on NCCL) and completed by wait() or the destructor.
class NeighbourExchange {
 public:
  // send_* may be undefined (nothing to send that way); recv_*_width columns
  // of `like`'s other sizes are received from each side (0: none). Every
  // leftward message of this pass is `leftward` columns wide on the ranks that
  // send one, every rightward one `rightward` (used by the gather fallback).
  NeighbourExchange(const PG& pg, const TpConvPlan& plan, int tag_base, const at::Tensor& like,
                    const at::Tensor& send_left, const at::Tensor& send_right,
                    int64_t recv_left_width, int64_t recv_right_width, int64_t leftward,
                    int64_t rightward);
  NeighbourExchange(const NeighbourExchange&) = delete;
  NeighbourExchange& operator=(const NeighbourExchange&) = delete;
  ~NeighbourExchange();
  void wait();
  at::Tensor from_left, from_right;  // valid after wait()

 private:
  std::vector<WorkPtr> works_;
  std::vector<at::Tensor> keep_;  // buffers the backend reads or writes
  // Python-implemented groups (torch's threaded test group) have no send/recv:
  // every rank all-gathers [leftward | rightward] slabs and keeps its
  // neighbours' parts (O(N) traffic; for tests, e.g. several ranks on one GPU).
  void gather_fallback(const PG& pg, const TpConvPlan& p, const at::Tensor& like,
                       const at::Tensor& send_left, const at::Tensor& send_right,
                       int64_t recv_left_width, int64_t recv_right_width, int64_t leftward,
                       int64_t rightward);
};

// Forward pass: the input columns the neighbours need (send_left/right of x)
// go out, the halo columns (halo_left/right) come in.
std::unique_ptr<NeighbourExchange> exchange_input_halos(const PG& pg, const TpConvPlan& plan, const at::Tensor& x);

// Backward pass: the gradients of the halo columns go back to their owners,
// the gradients of this rank's own border columns (send_left/right) come in.
std::unique_ptr<NeighbourExchange> return_halo_grads(const PG& pg, const TpConvPlan& plan,
                                                     const at::Tensor& like,
                                                     const at::Tensor& grad_halo_left,
                                                     const at::Tensor& grad_halo_right);

// Adds what a completed return_halo_grads exchange brought into grad_x's
// border columns (the ones this rank sent to its neighbours).
void add_halo_grads(const TpConvPlan& p, at::Tensor& grad_x, const NeighbourExchange& back);

}  // namespace cplib
