// cplib_c::_cuda_glue_probe (internal): one block forward, and optionally its
// backward, through the CUDA block helpers (ring_block_cuda*.cpp), the very
// functions and arguments the ring and Ulysses use on a GPU. On META tensors
// every ATen call goes through the stable dispatcher's argument and return
// conversion without a GPU, which is where the H100 run of a24d28d failed
// ("Expected Tensor but got Int" for ops returning SymInts):
// tests/test_cuda_glue.py runs it on CPU-only machines, for every backend.
// `backend`: the ring's codes (ring.h); auto (-1) resolves as the ring does.
// `masked`: the windows/documents path (an all-zero additive mask).
// Without `backward`, dq/dk/dv come back empty.
#include "common/aten.h"
#include "ring/ring_block.h"

namespace cplib::ring {
namespace {

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> cuda_glue_probe(
    const Tensor& q, const Tensor& k, const Tensor& v, int64_t backend, bool is_causal,
    bool masked, bool backward) {
  aten::NoGradGuard no_grad;
  Config cfg;
  cfg.backend = resolve_backend_cuda(backend, q, k, v, is_causal, std::nullopt);
  const Tensor mask = masked ? aten::zeros({q.size(2), k.size(2)}, aten::opts_of(q)) : Tensor();
  BlockResult r = masked ? block_forward_cuda_masked(cfg, q, k, v, mask)
                         : block_forward_cuda(cfg, q, k, v, is_causal);
  if (!backward) {
    const Tensor none = aten::empty({0}, aten::opts_of(q));
    return {r.out, r.lse, none, none, none};
  }
  const Tensor grad_out = aten::full(aten::sizes_of(r.out), 1.0, aten::opts_of(r.out));
  auto [dq, dk, dv] =
      masked ? block_backward_cuda_masked(cfg, grad_out, q, k, v, r.out, r.lse, mask)
             : block_backward_cuda(cfg, grad_out, q, k, v, r.out, r.lse, is_causal);
  return {r.out, r.lse, dq, dk, dv};
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(cplib_c, m) {
  m.def(
      "_cuda_glue_probe(Tensor q, Tensor k, Tensor v, int backend, bool is_causal, bool masked, "
      "bool backward) -> (Tensor out, Tensor lse, Tensor dq, Tensor dk, Tensor dv)");
}

STABLE_TORCH_LIBRARY_IMPL(cplib_c, Meta, m) {
  m.impl("_cuda_glue_probe", TORCH_BOX(&cuda_glue_probe));
}

#ifdef CPLIB_WITH_CUDA
STABLE_TORCH_LIBRARY_IMPL(cplib_c, CUDA, m) {
  m.impl("_cuda_glue_probe", TORCH_BOX(&cuda_glue_probe));
}
#endif

}  // namespace cplib::ring
