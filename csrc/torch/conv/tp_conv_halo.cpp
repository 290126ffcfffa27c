#include "conv/tp_conv_halo.h"

#include "cplib/halo.h"
#include "common/dtype.h"

#ifdef CPLIB_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

namespace cplib {
namespace {

// Tags per pass (+0: rightward, +1: leftward), so no message matches another.
constexpr int kTagInput = 0x6300, kTagGrad = 0x6310;

cplib_halo_slab slab_of(const at::Tensor& t, int64_t dim, int64_t start, int64_t width) {
  TORCH_CHECK(t.dim() <= CPLIB_HALO_MAX_DIMS, "cplib: halo tensors have at most ",
              CPLIB_HALO_MAX_DIMS, " dims");
  cplib_halo_slab s{};
  s.data = t.data_ptr();
  s.elem_size = t.element_size();
  s.ndim = static_cast<int>(t.dim());
  for (int64_t d = 0; d < t.dim(); ++d) {
    s.sizes[d] = t.size(d);
    s.strides[d] = t.stride(d);
  }
  s.dim = static_cast<int>(dim);
  s.start = start;
  s.width = width;
  return s;
}

std::vector<int64_t> slab_shape(const at::Tensor& t, int64_t dim, int64_t width) {
  auto s = t.sizes().vec();
  s[dim] = width;
  return s;
}

}  // namespace

at::Tensor pack_slab(const at::Tensor& t, int64_t dim, int64_t start, int64_t width) {
  at::Tensor buf = at::empty(slab_shape(t, dim, width), t.options());
  cplib_halo_slab s = slab_of(t, dim, start, width);
  if (t.is_cuda()) {
#ifdef CPLIB_WITH_CUDA
    check_status(cplib_halo_pack_cuda(&s, buf.data_ptr(),
                                      at::cuda::getCurrentCUDAStream(t.get_device()).stream()),
                 "CUDA halo pack");
#else
    TORCH_CHECK(false, "cplib was built without CUDA");
#endif
  } else {
    check_status(cplib_halo_pack_cpu(&s, buf.data_ptr()), "CPU halo pack");
  }
  return buf;
}

void unpack_slab(at::Tensor& t, int64_t dim, int64_t start, const at::Tensor& buf) {
  TORCH_CHECK(buf.is_contiguous() && buf.scalar_type() == t.scalar_type(),
              "cplib: halo buffer must be contiguous and of the tensor's dtype");
  cplib_halo_slab s = slab_of(t, dim, start, buf.size(dim));
  if (t.is_cuda()) {
#ifdef CPLIB_WITH_CUDA
    check_status(cplib_halo_unpack_cuda(&s, buf.const_data_ptr(),
                                        at::cuda::getCurrentCUDAStream(t.get_device()).stream()),
                 "CUDA halo unpack");
#else
    TORCH_CHECK(false, "cplib was built without CUDA");
#endif
  } else {
    check_status(cplib_halo_unpack_cpu(&s, buf.const_data_ptr()), "CPU halo unpack");
  }
}

NeighbourExchange::NeighbourExchange(const PG& pg, const TpConvPlan& p, int tag_base,
                                     const at::Tensor& like, const at::Tensor& send_left,
                                     const at::Tensor& send_right, int64_t recv_left_width,
                                     int64_t recv_right_width, int64_t leftward,
                                     int64_t rightward) {
  if (python_group(pg)) {
    gather_fallback(pg, p, like, send_left, send_right, recv_left_width, recv_right_width,
                    leftward, rightward);
    return;
  }
  const int to_right = tag_base, to_left = tag_base + 1;
  from_left = at::empty(slab_shape(like, p.dim, recv_left_width), like.options());
  from_right = at::empty(slab_shape(like, p.dim, recv_right_width), like.options());
  struct Op {
    at::Tensor buf;
    int peer, tag;
    bool send;
  };
  std::vector<Op> ops;
  if (recv_left_width) ops.push_back({from_left, p.rank - 1, to_right, false});
  if (recv_right_width) ops.push_back({from_right, p.rank + 1, to_left, false});
  if (send_left.defined()) ops.push_back({send_left, p.rank - 1, to_left, true});
  if (send_right.defined()) ops.push_back({send_right, p.rank + 1, to_right, true});
  if (ops.empty()) return;
  // NCCL: a send and a receive with the same peer would wait on each other
  // unless they are issued as one group; gloo runs each op on its own.
  const bool coalesce = like.is_cuda();
  if (coalesce) pg->startCoalescing(c10::DeviceType::CUDA);
  for (auto& op : ops) {
    keep_.push_back(op.buf);
    WorkPtr w = op.send ? send(pg, op.buf, op.peer, op.tag) : recv(pg, op.buf, op.peer, op.tag);
    if (!coalesce) works_.push_back(w);
  }
  if (coalesce) works_.push_back(pg->endCoalescing(c10::DeviceType::CUDA));
}

void NeighbourExchange::gather_fallback(const PG& pg, const TpConvPlan& p,
                                        const at::Tensor& like, const at::Tensor& send_left,
                                        const at::Tensor& send_right, int64_t recv_left_width,
                                        int64_t recv_right_width, int64_t leftward,
                                        int64_t rightward) {
  const int64_t d = p.dim, n = pg->getSize();
  at::Tensor mine = at::zeros(slab_shape(like, d, leftward + rightward), like.options());
  if (send_left.defined()) unpack_slab(mine, d, 0, send_left.contiguous());
  if (send_right.defined()) unpack_slab(mine, d, leftward, send_right.contiguous());
  auto all_shape = mine.sizes().vec();
  all_shape[0] *= n;
  at::Tensor all = at::empty(all_shape, mine.options());
  cplib::wait(all_gather_dim0(pg, all, mine));
  const int64_t b = mine.size(0);
  if (recv_left_width)
    from_left = pack_slab(all.narrow(0, (p.rank - 1) * b, b), d, leftward, recv_left_width);
  if (recv_right_width)
    from_right = pack_slab(all.narrow(0, (p.rank + 1) * b, b), d, 0, recv_right_width);
}

void NeighbourExchange::wait() {
  for (auto& w : works_) cplib::wait(w);
  works_.clear();
  keep_.clear();
}

NeighbourExchange::~NeighbourExchange() {
  // Unwound by an exception: the backend must be done with the buffers.
  try {
    wait();
  } catch (...) {
  }
}

std::unique_ptr<NeighbourExchange> exchange_input_halos(const PG& pg, const TpConvPlan& p,
                                                       const at::Tensor& x) {
  const at::Tensor left = p.send_left ? pack_slab(x, p.dim, 0, p.send_left) : at::Tensor();
  const at::Tensor right =
      p.send_right ? pack_slab(x, p.dim, p.width - p.send_right, p.send_right) : at::Tensor();
  return std::make_unique<NeighbourExchange>(pg, p, kTagInput, x, left, right, p.halo_left,
                                             p.halo_right, p.rh, p.lh);
}

std::unique_ptr<NeighbourExchange> return_halo_grads(const PG& pg, const TpConvPlan& p,
                                                     const at::Tensor& like,
                                                     const at::Tensor& grad_halo_left,
                                                     const at::Tensor& grad_halo_right) {
  return std::make_unique<NeighbourExchange>(pg, p, kTagGrad, like, grad_halo_left,
                                             grad_halo_right, p.send_left, p.send_right, p.lh,
                                             p.rh);
}

void add_halo_grads(const TpConvPlan& p, at::Tensor& grad_x, const NeighbourExchange& back) {
  if (p.send_left) grad_x.narrow(p.dim, 0, p.send_left).add_(back.from_left);
  if (p.send_right)
    grad_x.narrow(p.dim, p.width - p.send_right, p.send_right).add_(back.from_right);
}

}  // namespace cplib
