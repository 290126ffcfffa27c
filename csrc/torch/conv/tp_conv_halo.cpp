#include "conv/tp_conv_halo.h"

#include "common/aten.h"
#include "common/c_core.h"
#include "conv/conv_aten.h"
#include "cplib/halo.h"

namespace cplib {
namespace {

cplib_halo_slab slab_of(const Tensor& t, void* data, int64_t dim, int64_t start, int64_t width) {
  CPLIB_CHECK(t.dim() <= CPLIB_HALO_MAX_DIMS, "cplib: halo tensors have at most ",
              CPLIB_HALO_MAX_DIMS, " dims");
  cplib_halo_slab s{};
  s.data = data;
  s.elem_size = static_cast<int64_t>(t.element_size());
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

std::vector<int64_t> slab_shape(const Tensor& t, int64_t dim, int64_t width) {
  const auto sizes = t.sizes();
  std::vector<int64_t> s(sizes.begin(), sizes.end());
  s[dim] = width;
  return s;
}

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

// Packs t's slab into the contiguous memory at `dst` (on t's device).
void pack_into(const Tensor& t, int64_t dim, int64_t start, int64_t width, void* dst) {
  // The C core's slab type is shared by pack and unpack; pack only reads it.
  cplib_halo_slab s = slab_of(t, const_cast<void*>(t.const_data_ptr()), dim, start, width);
  if (t.is_cuda()) {
#ifdef CPLIB_WITH_CUDA
    check_status(cplib_halo_pack_cuda(&s, dst, current_cuda_stream(t)), "CUDA halo pack");
#else
    CPLIB_CHECK(false, "cplib was built without CUDA");
#endif
  } else {
    check_status(cplib_halo_pack_cpu(&s, dst), "CPU halo pack");
  }
}

}  // namespace

Tensor pack_slab(const Tensor& t, int64_t dim, int64_t start, int64_t width) {
  Tensor buf = torch::stable::new_empty(t, slab_shape(t, dim, width));
  pack_into(t, dim, start, width, buf.mutable_data_ptr());
  return buf;
}

void unpack_slab(Tensor& t, int64_t dim, int64_t start, const Tensor& buf) {
  CPLIB_CHECK(buf.is_contiguous() && buf.scalar_type() == t.scalar_type(),
              "cplib: halo buffer must be contiguous and of the tensor's dtype");
  cplib_halo_slab s = slab_of(t, t.mutable_data_ptr(), dim, start, buf.size(dim));
  if (t.is_cuda()) {
#ifdef CPLIB_WITH_CUDA
    check_status(cplib_halo_unpack_cuda(&s, buf.const_data_ptr(), current_cuda_stream(t)),
                 "CUDA halo unpack");
#else
    CPLIB_CHECK(false, "cplib was built without CUDA");
#endif
  } else {
    check_status(cplib_halo_unpack_cpu(&s, buf.const_data_ptr()), "CPU halo unpack");
  }
}

NeighbourExchange::NeighbourExchange(const Group& g, int64_t dim, const Tensor& like,
                                     const Slab& send_left, const Slab& send_right,
                                     int64_t recv_left_width, int64_t recv_right_width,
                                     int64_t leftward, int64_t rightward) {
  // Every rank takes part in the all-to-all, or none does.
  if (leftward == 0 && rightward == 0) return;
  left_shape_ = slab_shape(like, dim, recv_left_width);
  right_shape_ = slab_shape(like, dim, recv_right_width);
  const int64_t to_left = send_left.width ? numel_of(slab_shape(like, dim, send_left.width)) : 0;
  const int64_t to_right = send_right.width ? numel_of(slab_shape(like, dim, send_right.width)) : 0;
  // One flat buffer each way, in rank order: [to rank - 1 | to rank + 1].
  sent_ = torch::stable::new_empty(like, std::vector<int64_t>{to_left + to_right});
  char* base = static_cast<char*>(sent_.mutable_data_ptr());
  if (to_left) pack_into(send_left.src, dim, send_left.start, send_left.width, base);
  if (to_right)
    pack_into(send_right.src, dim, send_right.start, send_right.width,
              base + to_left * static_cast<int64_t>(like.element_size()));
  std::vector<int64_t> in_splits(static_cast<size_t>(g.size), 0), out_splits = in_splits;
  if (g.rank > 0) {
    in_splits[g.rank - 1] = to_left;
    out_splits[g.rank - 1] = numel_of(left_shape_);
  }
  if (g.rank + 1 < g.size) {
    in_splits[g.rank + 1] = to_right;
    out_splits[g.rank + 1] = numel_of(right_shape_);
  }
  received_ = all_to_all_split(g, sent_, out_splits, in_splits);
  pending_ = true;
}

void NeighbourExchange::wait() {
  if (!pending_) return;
  pending_ = false;
  cplib::wait(received_);
  const int64_t n_left = numel_of(left_shape_), n_right = numel_of(right_shape_);
  from_left = torch::stable::view(torch::stable::narrow(received_, 0, 0, n_left), left_shape_);
  from_right = torch::stable::view(torch::stable::narrow(received_, 0, n_left, n_right),
                                   right_shape_);
  sent_ = Tensor();
}

NeighbourExchange::~NeighbourExchange() {
  // Unwound by an exception: the backend must be done with the buffers.
  try {
    wait();
  } catch (...) {
  }
}

std::unique_ptr<NeighbourExchange> exchange_input_halos(const Group& g, const TpConvPlan& p,
                                                        const Tensor& x) {
  return std::make_unique<NeighbourExchange>(g, p.dim, x, Slab{x, 0, p.send_left},
                                             Slab{x, p.width - p.send_right, p.send_right},
                                             p.halo_left, p.halo_right, p.rh, p.lh);
}

std::unique_ptr<NeighbourExchange> return_halo_grads(const Group& g, const TpConvPlan& p,
                                                     const Tensor& like, const Slab& grad_halo_left,
                                                     const Slab& grad_halo_right) {
  return std::make_unique<NeighbourExchange>(g, p.dim, like, grad_halo_left, grad_halo_right,
                                             p.send_left, p.send_right, p.lh, p.rh);
}

void add_halo_grads(const TpConvPlan& p, Tensor& grad_x, const NeighbourExchange& back) {
  if (p.send_left) aten::add_(torch::stable::narrow(grad_x, p.dim, 0, p.send_left), back.from_left);
  if (p.send_right)
    aten::add_(torch::stable::narrow(grad_x, p.dim, p.width - p.send_right, p.send_right),
               back.from_right);
}

}  // namespace cplib
