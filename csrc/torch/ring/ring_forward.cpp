// Ring attention forward: each step attends the local q to the visiting k/v
// block through the plan's calls; the partial (out, lse) of every call is
// combined into the result once per row (merge/partial_sum.h), in fp32
// (fp64), over just the rows each call touched.
#include "ring/ring_forward.h"

#include <array>
#include <limits>
#include <optional>
#include <vector>

#include "attention/block.h"
#include "attention/heads.h"
#include "attention/sinks.h"
#include "common/aten.h"
#include "merge/partial_sum.h"
#include "ring/ring_plan.h"
#include "ring/ring_rotate.h"

namespace cplib::ring {

attention::BlockResult attend(const Config& cfg, const RingPlan& plan, const Call& c,
                              const Tensor& q, const Tensor& k, const Tensor& v) {
  if (c.kind != Visibility::partial)
    return attention::block_forward(cfg, q, k, v, c.kind == Visibility::causal);
  auto [mask, no_key] = plan.mask(c, aten::opts_of(q));
  attention::BlockResult r = attention::block_forward(cfg, q, k, v, false, mask);
  // Rows that see no key here contribute nothing: the kernels report lse 0
  // (CPU) for them, the merge needs -inf.
  r.out = aten::masked_fill(r.out, aten::view(no_key, {-1, 1}), 0.0);
  r.lse = aten::masked_fill(r.lse, no_key, -std::numeric_limits<double>::infinity());
  return r;
}

namespace {

// The calls of one step whose blocks run cuDNN's forward
// (attention::forwards_on_cudnn), all in one call: cuDNN is reached
// through a Python op (the stable dispatcher cannot return its SymInts), so
// a step costs one Python round trip however many calls it makes (documents
// and windows make several; a dense step makes one, which the per-block
// route serves alike). By call index; the other slots empty. GQA: each
// call's k/v are expanded into buffers of their own (they run together).
std::vector<std::optional<attention::BlockResult>> cudnn_step(const Config& cfg,
                                                              const std::vector<Call>& calls,
                                                              const Tensor& q, const KV& blk,
                                                              PartialSum& sum, int64_t row_bytes) {
  std::vector<std::optional<attention::BlockResult>> out(calls.size());
  if (!attention::forwards_on_cudnn(cfg, q, blk[1])) return out;
  std::vector<size_t> idx;
  for (size_t i = 0; i < calls.size(); ++i)
    if (calls[i].kind != Visibility::partial) idx.push_back(i);
  if (idx.size() < 2) return out;
  std::vector<std::array<Tensor, 3>> qkv;
  std::vector<int64_t> causal;
  int64_t bytes = 0;
  for (const size_t i : idx) {
    const Call& c = calls[i];
    const Tensor kr = aten::rows(blk[0], 2, c.k_local, c.k_len);
    const Tensor vr = aten::rows(blk[1], 2, c.k_local, c.k_len);
    attention::HeadExpander ek(cfg.groups, kr, c.k_len), ev(cfg.groups, vr, c.k_len);
    qkv.push_back({aten::rows(q, 2, c.q_local, c.q_len), ek(kr), ev(vr)});
    causal.push_back(c.kind == Visibility::causal);
    bytes += c.q_len * row_bytes;
  }
  sum.reserve(bytes);
  std::vector<attention::BlockResult> results = attention::block_forward_cudnn_step(cfg, qkv,
                                                                                    causal);
  for (size_t j = 0; j < idx.size(); ++j) out[idx[j]] = std::move(results[j]);
  return out;
}

}  // namespace

std::tuple<Tensor, Tensor> ring_forward(const Config& cfg, const Tensor& q, const Tensor& k,
                                        const Tensor& v, const Tensor& sinks) {
  if (cfg.pass_q) {
    auto [out, lse] = ring_forward_pass_q(cfg, q, k, v);
    if (!sinks.defined()) return {out, lse};
    Tensor acc = aten::to(out, lse.scalar_type());
    lse = attention::apply_sinks(acc, lse, sinks);
    return {aten::to(acc, q.scalar_type()), lse};
  }
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), Dv = v.size(3);
  const aten::Opts acc_opts = aten::opts_of(q).dtype_(attention::acc_dtype(q));
  // Each call's partial (out, lse) is held as its kernel gave it, and every
  // row is combined once at the end, in the accumulator dtype, rounded once
  // into q's (partial_sum.h): up to 4 whole outputs of fp16/bf16 held, twice
  // the float32 accumulator the ring merged into before.
  const std::vector<int64_t> sizes{B, H, Lq, Dv};
  PartialSum sum(sizes, acc_opts, /*weighted=*/true, held_budget(q, sizes, 2));
  const int64_t row_bytes = B * H * Dv * static_cast<int64_t>(q.element_size());

  const RingPlan plan(cfg);
  BlockRing ring(cfg, plan, k, v);
  attention::HeadExpander expand_k(cfg.groups, k, cfg.kv_layout.max_local_len()),
      expand_v(cfg.groups, v, cfg.kv_layout.max_local_len());
  for (int64_t s = 0; s < plan.steps(); ++s) {
    const KV blk = ring.fetch(s);
    if (!blk[0].defined()) continue;
    const std::vector<Call>& calls = plan.calls(s);
    std::vector<std::optional<attention::BlockResult>> ran = cudnn_step(cfg, calls, q, blk, sum,
                                                                        row_bytes);
    for (size_t i = 0; i < calls.size(); ++i) {
      const Call& c = calls[i];
      if (!ran[i]) {
        sum.reserve(c.q_len * row_bytes);
        ran[i] = attend(cfg, plan, c, aten::rows(q, 2, c.q_local, c.q_len),
                        expand_k(aten::rows(blk[0], 2, c.k_local, c.k_len)),
                        expand_v(aten::rows(blk[1], 2, c.k_local, c.k_len)));
      }
      sum.add(ran[i]->out, ran[i]->lse, c.q_local);
      ran[i].reset();  // held by the sum alone
    }
  }
  ring.finish();
  if (!sinks.defined()) {
    auto [out, lse] = sum.finish(q.scalar_type());
    return {out, lse};
  }
  // Once per row, after the combine: a sink merged per block would count
  // once per block.
  auto [out, lse] = sum.finish(acc_opts.dtype);
  lse = attention::apply_sinks(out, lse, sinks);
  if (out.scalar_type() != q.scalar_type()) out = aten::to(out, q.scalar_type());
  return {out, lse};
}

}  // namespace cplib::ring
