// The CUDA block kernels by name, and the choice among them: what the ring,
// Ulysses' local attention and the CUDA glue probe resolve `backend` with.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "common/stable.h"

// Internal to the extension (torch's stable types are hidden).
#pragma GCC visibility push(hidden)

namespace cplib::attention {

// The kernels as their at::SDPBackend values. "auto": chosen as
// scaled_dot_product_attention would (torch.nn.attention.sdpa_kernel is
// honoured). CPU always runs _scaled_dot_product_flash_attention_for_cpu
// and accepts only "auto" and "flash".
constexpr int64_t kBackendAuto = -1;
constexpr int64_t kBackendFlash = 1;
constexpr int64_t kBackendEfficient = 2;
constexpr int64_t kBackendCudnn = 3;
inline constexpr std::array<std::string_view, 4> kBackendNames{"auto", "flash", "efficient",
                                                               "cudnn"};
inline constexpr std::array<int64_t, 4> kBackendCodes{kBackendAuto, kBackendFlash,
                                                      kBackendEfficient, kBackendCudnn};

// A backend by name: ValueError naming `op` and the value when it is none
// of kBackendNames.
int64_t backend_code(const char* op, const std::string& name);
// The name of a backend code ("?" for none).
std::string_view backend_name(int64_t code);

// The backend of one block call: `backend` itself, or for auto the one
// scaled_dot_product_attention would pick for these shapes (k/v seen
// expanded to q's heads). Raises NotImplementedError when only the math
// backend would do. Compiled into every build (no CUDA runtime call).
int64_t resolve_backend_cuda(int64_t backend, const Tensor& q, const Tensor& k, const Tensor& v,
                             bool causal, std::optional<double> scale);
// The same for blocks of the given sizes (q heads; k/v seen expanded), with
// `like`'s dtype and device: what the ring resolves from inputs every rank
// agrees on (ring/ring_agreed.h: resolve_ring_backend).
struct BlockShape {
  int64_t batch = 1, heads = 1, q_len = 1, kv_len = 1, head_dim = 1, v_head_dim = 1;
};
int64_t resolve_backend_cuda(int64_t backend, const Tensor& like, const BlockShape& shape,
                             bool causal, std::optional<double> scale);

}  // namespace cplib::attention

#pragma GCC visibility pop
