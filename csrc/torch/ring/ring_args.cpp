// Argument validation of the ring ops: every check runs before any
// communication and reads nothing another rank could see differently, except
// cu_seqlens (the same on every rank by contract).
#include <cmath>
#include <sstream>

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
  TORCH_CHECK_VALUE(q.size(0) > 0, "cplib.", op, ": empty batch (q has shape ", q.sizes(), ")");
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

std::string join(const std::vector<int64_t>& v) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < v.size(); ++i) {
    if (i == 8 && v.size() > 12) {
      os << ", ...";
      i = v.size() - 3;
    }
    os << (i ? ", " : "") << v[i];
  }
  os << "]";
  return os.str();
}

// cu_seqlens as host integers, checked: [0, ..., S], strictly increasing.
std::vector<int64_t> document_bounds(const char* op, const at::Tensor& cu, int64_t seq_len) {
  TORCH_CHECK_VALUE(!at::isFloatingType(cu.scalar_type()) && !at::isComplexType(cu.scalar_type()) &&
                        cu.scalar_type() != at::kBool,
                    "cplib.", op, ": cu_seqlens must be an integer tensor, got dtype ",
                    cu.scalar_type());
  TORCH_CHECK_VALUE(cu.dim() == 1 && cu.numel() >= 2, "cplib.", op,
                    ": cu_seqlens must be 1-D with at least 2 entries [0, ..., S], got shape ",
                    cu.sizes());
  const at::Tensor host = cu.to(at::kCPU, at::kLong).contiguous();
  const int64_t* p = host.data_ptr<int64_t>();
  std::vector<int64_t> b(p, p + host.numel());
  TORCH_CHECK_VALUE(b.front() == 0, "cplib.", op, ": cu_seqlens must start at 0, got ",
                    b.front(), " in ", join(b));
  TORCH_CHECK_VALUE(b.back() == seq_len, "cplib.", op, ": cu_seqlens must end at the sequence "
                    "length ", seq_len, ", got ", b.back(), " in ", join(b));
  for (size_t i = 1; i < b.size(); ++i)
    TORCH_CHECK_VALUE(b[i] > b[i - 1], "cplib.", op, ": cu_seqlens must be strictly increasing, "
                      "got ", b[i - 1], " then ", b[i], " at index ", i, " in ", join(b));
  return b;
}

// Layouts and mask from the optional arguments.
void check_extras(const char* op, Config& cfg, const at::Tensor& q, const at::Tensor& k,
                  const Extras& ex) {
  const int64_t n = cfg.size, lq = q.size(2), lk = k.size(2);
  int64_t sq = lq * n, sk = lk * n;
  if (ex.seq_len) {
    const int64_t s = *ex.seq_len;
    TORCH_CHECK_VALUE(s >= n, "cplib.", op, ": seq_len=", s,
                      " is shorter than the world size ", n, " (every rank needs a token)");
    sq = sk = s;
  }
  const bool masked = ex.cu_seqlens.has_value() || ex.window.has_value();
  TORCH_CHECK_VALUE(!masked || sq == sk, "cplib.", op, ": cu_seqlens and window need q and k/v "
                    "of one global length, got q ", sq, " and kv ", sk);
  TORCH_CHECK_VALUE(!ex.per_document || (ex.cu_seqlens && ex.seq_len), "cplib.", op,
                    ": per_document=True (head-tail inside every document) needs cu_seqlens and "
                    "seq_len");
  Mask& m = cfg.mask;
  if (ex.cu_seqlens) m.bounds = document_bounds(op, *ex.cu_seqlens, sq);
  cfg.q_layout = {sq, n, cfg.load_balanced, {}};
  cfg.kv_layout = {sk, n, cfg.load_balanced, {}};
  if (ex.per_document) cfg.q_layout.documents = cfg.kv_layout.documents = m.bounds;
  if (ex.seq_len || ex.per_document) {
    const int64_t want = cfg.q_layout.local_len(cfg.rank);
    TORCH_CHECK_VALUE(lq == want && lk == want, "cplib.", op, ": seq_len=", sq, " over ", n,
                      " ranks (", ex.per_document ? "per-document head-tail"
                      : cfg.load_balanced ? "head-tail" : "sequential",
                      " layout) gives rank ", cfg.rank, " ", want, " rows, but q has ", lq,
                      " and k/v ", lk);
  }
  m.causal = cfg.causal;
  m.seq_len = std::max(sq, sk);
  m.left = m.right = m.seq_len;
  if (ex.window) {
    const auto& w = *ex.window;
    TORCH_CHECK_VALUE(w.size() == 2, "cplib.", op, ": window must be (left, right), got ",
                      join(w));
    TORCH_CHECK_VALUE(w[0] >= 0 && w[1] >= 0, "cplib.", op, ": window=", join(w),
                      " must be non-negative (None for no limit)");
    m.left = std::min(w[0], m.seq_len);
    m.right = std::min(w[1], m.seq_len);
  }
  if (cfg.causal) m.right = 0;
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
                  std::optional<double> scale, int64_t backend, int64_t rotate,
                  const Extras& extras) {
  TORCH_CHECK_VALUE(rotate >= 0 && rotate <= 2, "cplib.", op, ": rotate=", rotate,
                    " is not a rotation (0 = p2p, 1 = alltoall, 2 = allgather)");
  Config cfg = check_local_args(op, q, k, v, is_causal, scale, backend);
  // Without seq_len the global length is N times the local one, two equal
  // chunks per rank when load balanced.
  TORCH_CHECK_VALUE(extras.seq_len || extras.per_document || !load_balanced ||
                        (q.size(2) % 2 == 0 && k.size(2) % 2 == 0),
                    "cplib.", op,
                    ": load_balanced needs even local lengths (two chunks per rank), got q ",
                    q.size(2), " and kv ", k.size(2));
  cfg.pg = resolve_group(group_name);
  cfg.rank = cfg.pg->getRank();
  cfg.size = cfg.pg->getSize();
  cfg.load_balanced = load_balanced;
  cfg.rotate = static_cast<Rotate>(rotate);
  check_extras(op, cfg, q, k, extras);
  return cfg;
}

}  // namespace cplib::ring
