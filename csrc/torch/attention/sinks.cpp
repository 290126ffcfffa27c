#include "attention/sinks.h"

#include "common/aten.h"
#include "common/format.h"

namespace cplib::attention {

void check_sinks(const char* op, const Tensor& q, const Tensor& sinks) {
  CPLIB_CHECK_VALUE(sinks.dim() == 1 && sinks.size(0) == q.size(1), "cplib.", op,
                    ": sinks must have shape (", q.size(1), ",) (one logit per q head), got ",
                    sinks.sizes());
  CPLIB_CHECK_VALUE(sinks.device() == q.device(), "cplib.", op, ": sinks must be on ", q.device(),
                    ", got ", sinks.device());
  const auto dt = sinks.scalar_type();
  CPLIB_CHECK_VALUE(dt == q.scalar_type() || dt == ScalarType::Float || dt == ScalarType::Double,
                    "cplib.", op, ": sinks must have q's dtype (",
                    torch::headeronly::toString(q.scalar_type()), ") or float32/float64, got ",
                    torch::headeronly::toString(dt));
}

Tensor apply_sinks(Tensor& out, const Tensor& lse, const Tensor& sinks) {
  const auto acc = out.scalar_type();
  const Tensor s = aten::view(aten::to(sinks, acc), {1, -1, 1});
  const Tensor l = aten::to(lse, acc);
  Tensor sunk = aten::logaddexp(l, s);
  // Rows that saw no key (lse -inf) give exp(-inf - s) = 0: out stays 0.
  aten::mul_(out, torch::stable::unsqueeze(aten::exp(aten::subtract(l, sunk)), -1));
  return sunk;
}

}  // namespace cplib::attention
