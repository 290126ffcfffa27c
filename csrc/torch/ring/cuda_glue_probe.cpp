// cplib_c::_cuda_glue_probe (internal): one block forward, and optionally its
// backward, along the ring's own route to the CUDA kernels: k and v packed
// in one buffer as they travel (ring_rotate.h: Packing), GQA heads expanded
// as the ring expands them (HeadExpander), the backend resolved as the ring
// resolves it (resolve_ring_backend), block_forward/block_backward with the
// scale and MLA padding the ring applies, the partial merged into the
// accumulators, and the backward fed the accumulator's fp32 lse rows (in two
// row halves when not causal, as load-balanced steps are) and its gradients
// summed back over each GQA group. On META tensors every ATen call goes
// through the stable dispatcher's argument and return conversion without a
// GPU, which is where the H100 run of a24d28d failed ("Expected Tensor but
// got Int" for ops returning SymInts): tests/comm/test_cuda_glue.py runs it on
// CPU-only machines, for every backend.
// `backend`: by name (ring_call.h); "auto" resolves as the ring does.
// `masked`: the windows/documents path (an all-zero additive mask).
// `in_masked_call`: the block belongs to a call with documents, a window or
// positions (masked implies it), which decides its precision (block.cpp).
// Without `backward`, dq/dk/dv come back empty.
#include "attention/block.h"
#include "attention/checks.h"
#include "attention/heads.h"
#include "common/aten.h"
#include "ring/ring_agreed.h"
#include "ring/ring_forward.h"
#include "ring/ring_rotate.h"

namespace cplib::ring {
namespace {

// The ring's configuration of a one-rank ring over these tensors, taking the
// CUDA kernels whatever the device (meta, here).
Config probe_config(const Tensor& q, const Tensor& k, const Tensor& v, int64_t backend, bool causal,
                    std::optional<double> scale) {
  Config cfg;
  cfg.causal = causal;
  cfg.cuda = true;
  cfg.backend = backend;
  cfg.groups = q.size(1) / k.size(1);
  cfg.scale = attention::block_scale(scale, q, v);  // as check_args fixes it for MLA
  cfg.q_layout = {q.size(2), 1, false, {}, {}, {}, {}};
  cfg.kv_layout = {k.size(2), 1, false, {}, {}, {}, {}};
  cfg.backend = resolve_ring_backend(cfg, q, k, v);
  return cfg;
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> cuda_glue_probe(
    const Tensor& q, const Tensor& k, const Tensor& v, const std::string& backend_name,
    bool is_causal, bool masked, bool backward, std::optional<double> scale, bool in_masked_call) {
  const int64_t backend = attention::backend_code("_cuda_glue_probe", backend_name);
  aten::NoGradGuard no_grad;
  CPLIB_CHECK_VALUE(
      q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && k.size(1) > 0 && q.size(1) % k.size(1) == 0,
      "cplib._cuda_glue_probe: q (B, Hq, Lq, D), k/v (B, Hkv, Lk, D/Dv) with Hkv "
      "dividing Hq");
  const bool causal = is_causal && !masked;
  Config cfg = probe_config(q, k, v, backend, causal, scale);
  cfg.masked_call = masked || in_masked_call;
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), Lk = k.size(2), Dv = v.size(3);
  // K|V as a block arrives: one flat buffer, k then v.
  const Packing pack(k, v);
  const Tensor arrived = aten::empty({pack.total(Lk)}, aten::opts_of(k));
  const KV blk = pack.views(arrived, Lk);
  aten::copy_(blk[0], k);
  aten::copy_(blk[1], v);
  attention::HeadExpander expand_k(cfg.groups, k, Lk), expand_v(cfg.groups, v, Lk);
  const Tensor ek = expand_k(blk[0]), ev = expand_v(blk[1]);
  const Tensor mask = masked ? aten::zeros({Lq, Lk}, aten::opts_of(q)) : Tensor();

  const aten::Opts acc = aten::opts_of(q).dtype_(attention::acc_dtype(q));
  const attention::BlockResult r = attention::block_forward(cfg, q, ek, ev, causal, mask);
  Tensor out_acc = aten::empty({B, H, Lq, Dv}, acc), lse = aten::empty({B, H, Lq}, acc);
  aten::copy_(out_acc, r.out);
  aten::copy_(lse, r.lse);
  const Tensor out = aten::to(out_acc, q.scalar_type());
  if (!backward) {
    const Tensor none = aten::empty({0}, aten::opts_of(q));
    return {out, lse, none, none, none};
  }
  const Tensor grad_out = aten::full({B, H, Lq, Dv}, 1.0, aten::opts_of(q));
  Tensor dq = aten::zeros(aten::sizes_of(q), acc);
  Tensor dk = aten::zeros(aten::sizes_of(k), acc), dv = aten::zeros(aten::sizes_of(v), acc);
  const int64_t half = causal || Lq < 2 ? Lq : Lq / 2;
  for (int64_t start = 0; start < Lq; start += half) {
    const int64_t len = std::min(half, Lq - start);
    auto rows = [&](const Tensor& t) { return aten::rows(t, 2, start, len); };
    const Tensor m = masked ? aten::narrow(mask, 0, start, len) : Tensor();
    auto [gq, gk, gv] = attention::block_backward(cfg, rows(grad_out), rows(q), ek, ev, rows(out),
                                                  rows(lse), causal, m);
    aten::add_(rows(dq), gq);
    attention::reduce_heads_into(dk, gk, cfg.groups, /*accumulate=*/true);
    attention::reduce_heads_into(dv, gv, cfg.groups, /*accumulate=*/true);
  }
  const ScalarType dt = q.scalar_type();
  return {out, lse, aten::to(dq, dt), aten::to(dk, dt), aten::to(dv, dt)};
}

// cplib_c::_cuda_ring_forward_probe (internal): the ring's forward itself
// (ring_forward) on a ring of one rank over these tensors, along the CUDA
// route whatever the device (meta, here), with documents, a window and a
// layout (by name, ring_call.h) as the ring takes them: every step's calls, the one Python round
// trip a step's cuDNN forwards take (tests/comm/test_cuda_step_calls.py counts them), the partial
// results held and combined.
std::tuple<Tensor, Tensor> cuda_ring_forward_probe(const Tensor& q, const Tensor& k,
                                                   const Tensor& v, const std::string& backend_name,
                                                   bool is_causal,
                                                   std::optional<std::vector<int64_t>> cu_seqlens,
                                                   std::optional<std::vector<int64_t>> window,
                                                   const std::string& layout) {
  constexpr const char* kOp = "_cuda_ring_forward_probe";
  aten::NoGradGuard no_grad;
  CPLIB_CHECK_VALUE(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && k.size(1) > 0 &&
                        q.size(1) % k.size(1) == 0 && q.size(2) == k.size(2),
                    "cplib.", kOp, ": q (B, Hq, L, D), k/v (B, Hkv, L, D/Dv), Hkv dividing Hq");
  Config cfg;
  cfg.causal = is_causal;
  cfg.layout = parse_layout(kOp, layout);
  if (cu_seqlens) {
    check_bounds(kOp, *cu_seqlens, q.size(2));
    cfg.mask.bounds = *cu_seqlens;
  }
  lay_out(kOp, cfg, q.size(2), k.size(2), window);
  cfg.cuda = true;
  cfg.groups = q.size(1) / k.size(1);
  cfg.scale = attention::block_scale(std::nullopt, q, v);
  cfg.masked_call = cu_seqlens.has_value() || window.has_value();
  cfg.backend = attention::backend_code(kOp, backend_name);
  cfg.backend = resolve_ring_backend(cfg, q, k, v);
  return ring_forward(cfg, q, k, v);
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(cplib_c, m) {
  m.def(
      "_cuda_ring_forward_probe(Tensor q, Tensor k, Tensor v, str backend, bool is_causal, "
      "int[]? cu_seqlens=None, int[]? window=None, str layout='sequential') -> (Tensor out, "
      "Tensor lse)");
  m.def(
      "_cuda_glue_probe(Tensor q, Tensor k, Tensor v, str backend, bool is_causal, bool masked, "
      "bool backward, float? scale=None, bool in_masked_call=False) -> (Tensor out, Tensor lse, "
      "Tensor dq, Tensor dk, Tensor dv)");
}

STABLE_TORCH_LIBRARY_IMPL(cplib_c, Meta, m) {
  m.impl("_cuda_glue_probe", CPLIB_BOX(&cuda_glue_probe));
  m.impl("_cuda_ring_forward_probe", CPLIB_BOX(&cuda_ring_forward_probe));
}

#ifdef CPLIB_WITH_CUDA
STABLE_TORCH_LIBRARY_IMPL(cplib_c, CUDA, m) {
  m.impl("_cuda_glue_probe", CPLIB_BOX(&cuda_glue_probe));
  m.impl("_cuda_ring_forward_probe", CPLIB_BOX(&cuda_ring_forward_probe));
}
#endif

}  // namespace cplib::ring
