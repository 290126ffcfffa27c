// Argument validation and the per-step schedule of the ring (which rows of q
// meet which rows of the visiting k/v block).
#include <cmath>

#include "ring/ring.h"
#include "ring/ring_block.h"

namespace cplib::ring {

namespace {


void check_tensors(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK_VALUE(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "cplib.", op,
                    ": expected q, k, v of shape (B, H, S_local, D), got q ", q.sizes(), ", k ",
                    k.sizes(), ", v ", v.sizes());
  TORCH_CHECK_VALUE(q.device() == k.device() && q.device() == v.device(), "cplib.", op,
                    ": q, k, v must be on one device, got ", q.device(), ", ", k.device(), ", ",
                    v.device());
  TORCH_CHECK_VALUE(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
                    "cplib.", op, ": q, k, v must have one dtype, got ", q.scalar_type(), ", ",
                    k.scalar_type(), ", ", v.scalar_type());
  const auto dt = q.scalar_type();
  TORCH_CHECK_VALUE(dt == at::kFloat || dt == at::kDouble || dt == at::kBFloat16 || dt == at::kHalf,
                    "cplib.", op, ": unsupported dtype ", dt,
                    " (expected float32, float64, bfloat16 or float16)");
  TORCH_CHECK_VALUE(q.size(0) == k.size(0) && q.size(0) == v.size(0), "cplib.", op,
                    ": batch sizes differ: q ", q.size(0), ", k ", k.size(0), ", v ", v.size(0));
  TORCH_CHECK_VALUE(k.size(1) == v.size(1) && k.size(2) == v.size(2), "cplib.", op,
                    ": k ", k.sizes(), " and v ", v.sizes(), " must agree in heads and length");
  TORCH_CHECK_VALUE(q.size(3) == k.size(3), "cplib.", op, ": q head dim ", q.size(3),
                    " differs from k head dim ", k.size(3));
  TORCH_CHECK_VALUE(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "cplib.", op, ": q has ",
                    q.size(1), " heads, which is not a multiple of k/v's ", k.size(1), " heads");
  TORCH_CHECK_VALUE(q.size(2) > 0 && k.size(2) > 0, "cplib.", op,
                    ": empty local sequence (q length ", q.size(2), ", kv length ", k.size(2), ")");
  TORCH_CHECK_VALUE(q.size(3) > 0 && v.size(3) > 0, "cplib.", op, ": empty head dim");
  if (!q.is_cuda()) {
    TORCH_CHECK_VALUE(q.device().is_cpu(), "cplib.", op, ": unsupported device ", q.device());
    TORCH_CHECK_VALUE(v.size(3) == q.size(3), "cplib.", op, ": the CPU kernel needs v's head dim (",
                      v.size(3), ") to equal q/k's (", q.size(3), ")");
  }
}

}  // namespace

Config check_local_args(const char* op, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, bool is_causal, std::optional<double> scale,
                        int64_t backend) {
  check_tensors(op, q, k, v);
  TORCH_CHECK_VALUE(backend == kBackendAuto || backend == kBackendFlash ||
                        backend == kBackendEfficient || backend == kBackendCudnn,
                    "cplib.", op, ": backend=", backend,
                    " is not a backend (-1 = auto, 1 = flash, 2 = efficient, 3 = cudnn)");
  TORCH_CHECK_VALUE(q.is_cuda() || backend == kBackendAuto || backend == kBackendFlash, "cplib.",
                    op, ": backend=", backend, " needs CUDA; CPU tensors always use flash (1)");
  TORCH_CHECK_VALUE(!scale || (std::isfinite(*scale) && *scale > 0.0), "cplib.", op, ": scale=",
                    scale ? *scale : 0.0, " must be a finite positive number or None");
  TORCH_CHECK_VALUE(!is_causal || q.size(2) == k.size(2), "cplib.", op,
                    ": is_causal needs equal local q and kv lengths, got q ", q.size(2), " and kv ",
                    k.size(2));
  Config cfg;
  cfg.causal = is_causal;
  cfg.scale = scale;
  cfg.backend = backend;
#ifdef CPLIB_WITH_CUDA
  // Chosen once, before any communication, so every rank fails alike.
  if (q.is_cuda()) cfg.backend = resolve_backend_cuda(backend, q, k, v, is_causal, scale);
#endif
  cfg.groups = q.size(1) / k.size(1);
  return cfg;
}

Config check_args(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  std::string_view group_name, bool is_causal, bool load_balanced,
                  std::optional<double> scale, int64_t backend, int64_t rotate) {
  TORCH_CHECK_VALUE(rotate >= 0 && rotate <= 2, "cplib.", op, ": rotate=", rotate,
                    " is not a rotation (0 = p2p, 1 = alltoall, 2 = allgather)");
  Config cfg = check_local_args(op, q, k, v, is_causal, scale, backend);
  TORCH_CHECK_VALUE(!load_balanced || (q.size(2) % 2 == 0 && k.size(2) % 2 == 0), "cplib.", op,
                    ": load_balanced needs even local lengths (two chunks per rank), got q ",
                    q.size(2), " and kv ", k.size(2));
  cfg.pg = resolve_group(group_name);
  cfg.rank = cfg.pg->getRank();
  cfg.size = cfg.pg->getSize();
  cfg.load_balanced = load_balanced;
  cfg.rotate = static_cast<Rotate>(rotate);
  return cfg;
}

Step plan_step(const Config& cfg, int64_t i, int64_t q_len, int64_t kv_len) {
  Step s;
  s.q_len = q_len;
  s.kv_len = kv_len;
  if (!cfg.causal) return s;  // every block, every row; the layout does not matter
  if (i == 0) {
    // The local block: causal on [A|B]x[A|B] is exact for the head-tail
    // layout too (A precedes B globally).
    s.causal = true;
    return s;
  }
  const int64_t src = ((cfg.rank - i) % cfg.size + cfg.size) % cfg.size;
  if (!cfg.load_balanced) {
    s.skip = src > cfg.rank;  // a later rank's keys are all in the future
    return s;
  }
  if (src < cfg.rank) {
    // Its head chunk precedes both of ours, its tail follows both.
    s.kv_len = kv_len / 2;
  } else {
    // Both of its chunks sit between our head and our tail: only the tail attends.
    s.q_start = q_len / 2;
    s.q_len = q_len / 2;
  }
  return s;
}

}  // namespace cplib::ring
