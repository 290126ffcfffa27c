// Halo exchange: the neighbour messages (both directions in one all-to-all,
// in flight while the caller computes) and slab packing through the C core
// (csrc/core/halo.c, csrc/cuda/halo.cu). tp_convolution's spatial halos and
// seq_halo's sequence halos (conv/seq_halo.cpp) both travel this way.
#pragma once

#include <memory>
#include <vector>

#include "comm/collectives.h"
#include "common/stable.h"
#include "conv/tp_conv_plan.h"

namespace cplib {

// t[..., start:start+width, ...] along dim -> fresh contiguous tensor.
Tensor pack_slab(const Tensor& t, int64_t dim, int64_t start, int64_t width);
// Contiguous buf -> t[..., start:start+buf.size(dim), ...].
void unpack_slab(Tensor& t, int64_t dim, int64_t start, const Tensor& buf);

// torch::stable's types are hidden (one copy per extension): so are the
// types that hold them.
#pragma GCC visibility push(hidden)

// Columns [start, start + width) of `src` along the plan's dim (width 0: nothing).
struct Slab {
  Tensor src;
  int64_t start = 0, width = 0;
};

// Messages to and from the two neighbours (group ranks g.rank - 1 and
// g.rank + 1), slabs along `dim`: packed into one buffer and sent as one
// all-to-all (non-empty only towards the neighbours) on construction,
// completed by wait() or the destructor.
class NeighbourExchange {
 public:
  // recv_*_width columns of `like`'s other sizes are received from each side
  // (0: none). Every leftward message of this pass is `leftward` columns wide
  // on the ranks that send one, every rightward one `rightward`: when both are
  // 0 no rank has anything to send, and the collective is skipped everywhere.
  NeighbourExchange(const Group& g, int64_t dim, const Tensor& like, const Slab& send_left,
                    const Slab& send_right, int64_t recv_left_width, int64_t recv_right_width,
                    int64_t leftward, int64_t rightward);
  NeighbourExchange(const NeighbourExchange&) = delete;
  NeighbourExchange& operator=(const NeighbourExchange&) = delete;
  ~NeighbourExchange();
  void wait();
  Tensor from_left, from_right;  // valid after wait()

 private:
  bool pending_ = false;
  Tensor sent_, received_;  // the all-to-all's buffers, until wait()
  std::vector<int64_t> left_shape_, right_shape_;
};

#pragma GCC visibility pop

// Forward pass: the input columns the neighbours need (send_left/right of x)
// go out, the halo columns (halo_left/right) come in.
std::unique_ptr<NeighbourExchange> exchange_input_halos(const Group& g, const TpConvPlan& plan,
                                                        const Tensor& x);

// Backward pass: the gradients of the halo columns go back to their owners,
// the gradients of this rank's own border columns (send_left/right) come in.
std::unique_ptr<NeighbourExchange> return_halo_grads(const Group& g, const TpConvPlan& plan,
                                                     const Tensor& like, const Slab& grad_halo_left,
                                                     const Slab& grad_halo_right);

// Adds what a completed return_halo_grads exchange brought into grad_x's
// border columns (the ones this rank sent to its neighbours).
void add_halo_grads(const TpConvPlan& p, Tensor& grad_x, const NeighbourExchange& back);

}  // namespace cplib
