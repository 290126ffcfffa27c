#include "tp_conv_halo.h"

#include <vector>

#include "cplib/halo.h"
#include "dtype.h"

#ifdef CPLIB_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

namespace cplib {
namespace {

// Distinct tags per direction and pass, so no message can match another.
constexpr int kTagFwdToRight = 0x6301, kTagFwdToLeft = 0x6302;
constexpr int kTagBwdToRight = 0x6303, kTagBwdToLeft = 0x6304;

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

// t[..., start:start+width, ...] -> fresh contiguous tensor.
at::Tensor pack(const at::Tensor& t, int64_t dim, int64_t start, int64_t width) {
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

// Contiguous buf -> t[..., start:start+buf.size(dim), ...].
void unpack(at::Tensor& t, int64_t dim, int64_t start, const at::Tensor& buf) {
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

struct P2P {
  at::Tensor buf;
  int peer;
  int tag;
  bool send;
};

// Posts every send and receive before waiting on any. NCCL needs them in one
// coalesced group (a send and a receive with the same peer would otherwise
// wait on each other); gloo runs each op on its own.
class Exchange {
 public:
  Exchange(const PG& pg, std::vector<P2P> ops) : pg_(pg), ops_(std::move(ops)) {
    if (ops_.empty()) return;
    coalesce_ = ops_[0].buf.is_cuda();
    if (coalesce_) pg_->startCoalescing(c10::DeviceType::CUDA);
    for (auto& op : ops_)
      works_.push_back(op.send ? send(pg_, op.buf, op.peer, op.tag)
                               : recv(pg_, op.buf, op.peer, op.tag));
    if (coalesce_) {
      works_.clear();  // the group's one handle covers every op
      works_.push_back(pg_->endCoalescing(c10::DeviceType::CUDA));
    }
  }
  void wait_all() {
    for (auto& w : works_) wait(w);
    works_.clear();
  }
  ~Exchange() {
    // An exception between posting and waiting must not leave buffers that
    // the backend still reads or writes.
    try {
      wait_all();
    } catch (...) {
    }
  }

 private:
  PG pg_;
  std::vector<P2P> ops_;
  std::vector<WorkPtr> works_;
  bool coalesce_ = false;
};

}  // namespace

at::Tensor extend_input(const PG& pg, const TpConvPlan& p, const at::Tensor& x) {
  const at::Tensor xc = x.contiguous();
  const int64_t d = p.dim, w = p.width;
  at::Tensor from_left = at::empty(slab_shape(xc, d, p.halo_left), xc.options());
  at::Tensor from_right = at::empty(slab_shape(xc, d, p.halo_right), xc.options());
  std::vector<P2P> ops;
  if (p.halo_left) ops.push_back({from_left, p.rank - 1, kTagFwdToRight, false});
  if (p.halo_right) ops.push_back({from_right, p.rank + 1, kTagFwdToLeft, false});
  if (p.send_left) ops.push_back({pack(xc, d, 0, p.send_left), p.rank - 1, kTagFwdToLeft, true});
  if (p.send_right)
    ops.push_back({pack(xc, d, w - p.send_right, p.send_right), p.rank + 1, kTagFwdToRight, true});
  Exchange ex(pg, std::move(ops));

  at::Tensor ext = at::empty(p.extended_sizes(xc), xc.options());
  unpack(ext, d, p.left, xc);
  if (p.left > p.halo_left) ext.narrow(d, 0, p.left).zero_();  // global border: zero padding
  if (p.right > p.halo_right) ext.narrow(d, p.left + w, p.right).zero_();
  ex.wait_all();
  if (p.halo_left) unpack(ext, d, 0, from_left);
  if (p.halo_right) unpack(ext, d, p.left + w, from_right);
  return ext;
}

at::Tensor return_halo_grads(const PG& pg, const TpConvPlan& p, const at::Tensor& grad_ext) {
  const at::Tensor g = grad_ext.contiguous();
  const int64_t d = p.dim, w = p.width;
  // The neighbours return what they received from this rank: send_* columns.
  at::Tensor from_left = at::empty(slab_shape(g, d, p.send_left), g.options());
  at::Tensor from_right = at::empty(slab_shape(g, d, p.send_right), g.options());
  std::vector<P2P> ops;
  if (p.send_left) ops.push_back({from_left, p.rank - 1, kTagBwdToRight, false});
  if (p.send_right) ops.push_back({from_right, p.rank + 1, kTagBwdToLeft, false});
  if (p.halo_left) ops.push_back({pack(g, d, 0, p.halo_left), p.rank - 1, kTagBwdToLeft, true});
  if (p.halo_right)
    ops.push_back({pack(g, d, p.left + w, p.halo_right), p.rank + 1, kTagBwdToRight, true});
  Exchange ex(pg, std::move(ops));

  at::Tensor grad_x = pack(g, d, p.left, w);
  ex.wait_all();
  if (p.send_left) grad_x.narrow(d, 0, p.send_left).add_(from_left);
  if (p.send_right) grad_x.narrow(d, w - p.send_right, p.send_right).add_(from_right);
  return grad_x;
}

}  // namespace cplib
