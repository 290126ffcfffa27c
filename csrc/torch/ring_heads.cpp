#include "ring_heads.h"

namespace cplib::ring {

at::Tensor pack_kv(const at::Tensor& k, const at::Tensor& v) {
  const int64_t nk = k.numel();
  at::Tensor flat = at::empty({nk + v.numel()}, k.options().memory_format(at::MemoryFormat::Contiguous));
  flat.narrow(0, 0, nk).view(k.sizes()).copy_(k);
  flat.narrow(0, nk, v.numel()).view(v.sizes()).copy_(v);
  return flat;
}

std::pair<at::Tensor, at::Tensor> unpack_kv(const at::Tensor& flat, at::IntArrayRef k_sizes,
                                            at::IntArrayRef v_sizes) {
  const int64_t nk = c10::multiply_integers(k_sizes);
  const int64_t nv = c10::multiply_integers(v_sizes);
  return {flat.narrow(0, 0, nk).view(k_sizes), flat.narrow(0, nk, nv).view(v_sizes)};
}

HeadExpander::HeadExpander(int64_t groups, const at::Tensor& like) : groups_(groups) {
  if (groups_ > 1) storage_ = at::empty({like.numel() * groups_}, like.options());
}

at::Tensor HeadExpander::operator()(const at::Tensor& x) {
  if (groups_ == 1) return x;
  const int64_t B = x.size(0), H = x.size(1), L = x.size(2), D = x.size(3);
  at::Tensor dst = storage_.narrow(0, 0, x.numel() * groups_).view({B, H, groups_, L, D});
  dst.copy_(x.unsqueeze(2).expand({B, H, groups_, L, D}));
  return dst.view({B, H * groups_, L, D});
}

void add_reduced_heads(at::Tensor acc, const at::Tensor& g, int64_t groups) {
  if (groups == 1) {
    acc.add_(g);
    return;
  }
  const int64_t B = acc.size(0), H = acc.size(1), L = acc.size(2), D = acc.size(3);
  acc.add_(g.reshape({B, H, groups, L, D}).sum(2, /*keepdim=*/false, acc.scalar_type()));
}

}  // namespace cplib::ring
