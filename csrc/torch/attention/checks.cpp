#include "attention/checks.h"

#include <cmath>

#include "common/format.h"

namespace cplib::attention {
namespace {

// q, k, v themselves. With explicit positions a rank may hold no queries or
// no keys (allow_empty).
void check_tensors(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                   bool allow_empty) {
  CPLIB_CHECK_VALUE(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "cplib.", op,
                    ": expected q, k, v of shape (B, H, S_local, D), got q ", q.sizes(), ", k ",
                    k.sizes(), ", v ", v.sizes());
  CPLIB_CHECK_VALUE(q.device() == k.device() && q.device() == v.device(), "cplib.", op,
                    ": q, k, v must be on one device, got ", q.device(), ", ", k.device(), ", ",
                    v.device());
  CPLIB_CHECK_VALUE(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
                    "cplib.", op, ": q, k, v must have one dtype, got ", q.scalar_type(), ", ",
                    k.scalar_type(), ", ", v.scalar_type());
  const auto dt = q.scalar_type();
  CPLIB_CHECK_VALUE(dt == ScalarType::Float || dt == ScalarType::Double ||
                        dt == ScalarType::BFloat16 || dt == ScalarType::Half,
                    "cplib.", op, ": unsupported dtype ", dt,
                    " (expected float32, float64, bfloat16 or float16)");
  CPLIB_CHECK_VALUE(q.size(0) == k.size(0) && q.size(0) == v.size(0), "cplib.", op,
                    ": batch sizes differ: q ", q.size(0), ", k ", k.size(0), ", v ", v.size(0));
  CPLIB_CHECK_VALUE(q.size(0) > 0, "cplib.", op, ": empty batch (q has shape ", q.sizes(), ")");
  CPLIB_CHECK_VALUE(k.size(1) == v.size(1) && k.size(2) == v.size(2), "cplib.", op, ": k ",
                    k.sizes(), " and v ", v.sizes(), " must agree in heads and length");
  CPLIB_CHECK_VALUE(q.size(3) == k.size(3), "cplib.", op, ": q head dim ", q.size(3),
                    " differs from k head dim ", k.size(3));
  CPLIB_CHECK_VALUE(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "cplib.", op, ": q has ",
                    q.size(1), " heads, which is not a multiple of k/v's ", k.size(1), " heads");
  CPLIB_CHECK_VALUE(allow_empty || (q.size(2) > 0 && k.size(2) > 0), "cplib.", op,
                    ": empty local sequence (q length ", q.size(2), ", kv length ", k.size(2), ")");
  CPLIB_CHECK_VALUE(q.size(3) > 0 && v.size(3) > 0, "cplib.", op, ": empty head dim");
  if (!q.is_cuda())
    CPLIB_CHECK_VALUE(q.device().type() == DeviceType::CPU, "cplib.", op, ": unsupported device ",
                      q.device());
}

}  // namespace

std::optional<double> block_scale(std::optional<double> scale, const Tensor& q, const Tensor& v) {
  if (scale || q.size(3) == v.size(3)) return scale;
  return 1.0 / std::sqrt(static_cast<double>(q.size(3)));
}

BlockConfig check_block_args(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                             bool is_causal, std::optional<double> scale, int64_t backend,
                             bool positions) {
  check_tensors(op, q, k, v, positions);
  CPLIB_CHECK_VALUE(backend_name(backend) != "?", "cplib.", op, ": backend=", backend,
                    " is not a backend code");
  CPLIB_CHECK_VALUE(q.is_cuda() || backend == kBackendAuto || backend == kBackendFlash, "cplib.",
                    op, ": backend='", backend_name(backend),
                    "' needs CUDA; CPU tensors always use 'flash'");
  CPLIB_CHECK_VALUE(!scale || (std::isfinite(*scale) && *scale > 0.0), "cplib.", op,
                    ": scale=", scale ? *scale : 0.0, " must be a finite positive number or None");
  CPLIB_CHECK_VALUE(!is_causal || positions || q.size(2) == k.size(2), "cplib.", op,
                    ": is_causal needs equal local q and kv lengths, got q ", q.size(2), " and kv ",
                    k.size(2));
  BlockConfig cfg;
  cfg.causal = is_causal;
  cfg.scale = block_scale(scale, q, v);
  cfg.backend = backend;
  cfg.cuda = q.is_cuda();
  cfg.groups = q.size(1) / k.size(1);
  return cfg;
}

BlockConfig check_local_args(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                             bool is_causal, std::optional<double> scale, int64_t backend) {
  BlockConfig cfg = check_block_args(op, q, k, v, is_causal, scale, backend, false);
  // One call on these very shapes (the ring instead resolves from what
  // every rank agrees on: resolve_ring_backend).
  if (cfg.cuda && q.size(2) > 0 && k.size(2) > 0)
    cfg.backend = resolve_backend_cuda(backend, q, k, v, is_causal, cfg.scale);
  return cfg;
}

}  // namespace cplib::attention
