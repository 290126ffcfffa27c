// The backends by name, and resolve_backend_cuda: for auto, ATen's own choice
// (_fused_sdp_choice) for the shapes the block kernels will see.
#include "attention/backend.h"

#include <algorithm>
#include <vector>

#include "attention/kernels.h"
#include "common/aten.h"
#include "common/names.h"

namespace cplib::attention {
namespace {

int64_t checked_choice(int64_t b, const Tensor& like, int64_t head_dim) {
  CPLIB_CHECK_NOT_IMPLEMENTED(b == kBackendFlash || b == kBackendEfficient || b == kBackendCudnn,
                              "cplib.ring_sdpa: no fused SDPA backend returning a log-sum-exp "
                              "accepts these inputs (dtype ",
                              torch::headeronly::toString(like.scalar_type()), ", head dim ",
                              head_dim, "); scaled_dot_product_attention would pick backend ", b);
  return b;
}

}  // namespace

int64_t backend_code(const char* op, const std::string& name) {
  return kBackendCodes[checked_index(op, "backend", name, kBackendNames)];
}

std::string_view backend_name(int64_t code) {
  for (size_t i = 0; i < kBackendCodes.size(); ++i)
    if (kBackendCodes[i] == code) return kBackendNames[i];
  return "?";
}

int64_t resolve_backend_cuda(int64_t backend, const Tensor& q, const Tensor& k, const Tensor& v,
                             bool causal, std::optional<double> scale) {
  if (backend != kBackendAuto) return backend;
  // The blocks see k/v expanded to q's heads: ask about that shape (a
  // stride-0 view, no copy).
  auto as_q_heads = [&q](const Tensor& t) {
    return aten::expand(aten::narrow(t, 1, 0, 1), {t.size(0), q.size(1), t.size(2), t.size(3)});
  };
  // MLA (v's head dim below q/k's): flash and cuDNN get v zero-padded to
  // q/k's head dim (block.cpp), so ask about that shape.
  const Tensor& v_seen = v.size(3) < q.size(3) ? k : v;
  return checked_choice(fused_sdp_choice(q, as_q_heads(k), as_q_heads(v_seen), causal, scale), q,
                        q.size(3));
}

int64_t resolve_backend_cuda(int64_t backend, const Tensor& like, const BlockShape& shape,
                             bool causal, std::optional<double> scale) {
  if (backend != kBackendAuto) return backend;
  // Stand-ins of the given sizes, dense (B, H, L, D) strides, over one small
  // buffer: _fused_sdp_choice reads sizes, strides, dtype and device, never
  // the data, so they need no memory of their own. MLA as above.
  const int64_t dv = shape.v_head_dim < shape.head_dim ? shape.head_dim : shape.v_head_dim;
  const Tensor buf = aten::empty({std::max(shape.head_dim, dv)}, aten::opts_of(like));
  auto stand_in = [&](int64_t len, int64_t d) {
    const std::vector<int64_t> sizes{shape.batch, shape.heads, len, d};
    return aten::reinterpret(buf, sizes, aten::contiguous_strides(sizes), 0);
  };
  const int64_t b = fused_sdp_choice(stand_in(shape.q_len, shape.head_dim),
                                     stand_in(shape.kv_len, shape.head_dim),
                                     stand_in(shape.kv_len, dv), causal, scale);
  return checked_choice(b, like, shape.head_dim);
}

}  // namespace cplib::attention
