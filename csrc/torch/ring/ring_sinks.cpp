// Attention sinks (gpt-oss): one learned logit per q head that joins every
// row's softmax denominator and contributes no value. Applied once to the
// merged (out, lse); the block backward run with the sunk (out', lse') is
// then exact for q, k and v (cplib/_ring.py adds the sinks' own gradient).
#include "ring/ring.h"

namespace cplib::ring {

void check_sinks(const char* op, const at::Tensor& q, const at::Tensor& sinks) {
  TORCH_CHECK_VALUE(sinks.dim() == 1 && sinks.size(0) == q.size(1), "cplib.", op,
                    ": sinks must have shape (", q.size(1), ",) (one logit per q head), got ",
                    sinks.sizes());
  TORCH_CHECK_VALUE(sinks.device() == q.device(), "cplib.", op, ": sinks must be on ",
                    q.device(), ", got ", sinks.device());
  const auto dt = sinks.scalar_type();
  TORCH_CHECK_VALUE(dt == q.scalar_type() || dt == at::kFloat || dt == at::kDouble, "cplib.", op,
                    ": sinks must have q's dtype (", q.scalar_type(),
                    ") or float32/float64, got ", dt);
}

at::Tensor apply_sinks(at::Tensor& out, const at::Tensor& lse, const at::Tensor& sinks) {
  const auto acc = out.scalar_type();
  at::Tensor s = sinks.to(acc).view({1, -1, 1});
  at::Tensor sunk = at::logaddexp(lse.to(acc), s);
  // Rows that saw no key (lse -inf) give exp(-inf - s) = 0: out stays 0.
  out.mul_(at::exp(lse.to(acc) - sunk).unsqueeze(-1));
  return sunk;
}

}  // namespace cplib::ring
