// cplib_c::decode_sdpa: attention of the newest T tokens (q, the same on
// every rank) against a KV cache sharded over the group in any order. Each
// rank attends q to its own shard (masked on positions: causal, optionally
// windowed), then one all-gather of the packed partial (out | lse) and a
// merge in rank order, so every rank ends with the same exact result.
#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "attention/block.h"
#include "attention/checks.h"
#include "comm/collectives.h"
#include "comm/handshake.h"
#include "common/aten.h"
#include "common/checks.h"
#include "common/format.h"
#include "merge/merge_op.h"

namespace cplib::decode {
namespace {

void check_positions(const std::optional<Tensor>& pos, const char* name, int64_t rows,
                     const char* rows_of) {
  if (!pos) return;
  const Tensor& p = *pos;
  CPLIB_CHECK_VALUE(is_integer(p.scalar_type()), "cplib.decode_sdpa: ", name,
                    " must be an integer tensor, got dtype ", p.scalar_type());
  CPLIB_CHECK_VALUE(p.dim() == 1, "cplib.decode_sdpa: ", name,
                    " must be 1-D (one global position per row), got shape ", p.sizes());
  CPLIB_CHECK_VALUE(p.numel() == rows, "cplib.decode_sdpa: ", name, " has ", p.numel(),
                    " positions but ", rows_of, " has ", rows, " rows");
}

void check_args(const Tensor& q, const Tensor& k, const Tensor& v,
                const std::optional<Tensor>& q_pos, const std::optional<Tensor>& kv_pos,
                const std::optional<std::vector<int64_t>>& window, std::optional<double> scale) {
  CPLIB_CHECK_VALUE(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
                    "cplib.decode_sdpa: expected q (B, Hq, T, D) and k, v (B, Hkv, L_local, D), "
                    "got q ",
                    q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  CPLIB_CHECK_VALUE(q.device() == k.device() && q.device() == v.device(),
                    "cplib.decode_sdpa: q, k, v must be on one device");
  CPLIB_CHECK_VALUE(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
                    "cplib.decode_sdpa: q, k, v must have one dtype, got ", q.scalar_type(), ", ",
                    k.scalar_type(), ", ", v.scalar_type());
  const auto dt = q.scalar_type();
  CPLIB_CHECK_VALUE(dt == ScalarType::Float || dt == ScalarType::Double ||
                        dt == ScalarType::BFloat16 || dt == ScalarType::Half,
                    "cplib.decode_sdpa: unsupported dtype ", dt);
  CPLIB_CHECK_VALUE(q.size(2) >= 1,
                    "cplib.decode_sdpa: q needs at least one token, got T = ", q.size(2));
  CPLIB_CHECK_VALUE(q.size(0) == k.size(0) && q.size(0) == v.size(0),
                    "cplib.decode_sdpa: batch sizes differ: q ", q.size(0), ", k ", k.size(0),
                    ", v ", v.size(0));
  CPLIB_CHECK_VALUE(k.size(1) == v.size(1) && k.size(2) == v.size(2), "cplib.decode_sdpa: k ",
                    k.sizes(), " and v ", v.sizes(), " must agree in heads and length");
  CPLIB_CHECK_VALUE(q.size(3) == k.size(3), "cplib.decode_sdpa: q head dim ", q.size(3),
                    " differs from k head dim ", k.size(3));
  CPLIB_CHECK_VALUE(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "cplib.decode_sdpa: q has ",
                    q.size(1), " heads, which is not a multiple of k/v's ", k.size(1), " heads");
  CPLIB_CHECK_VALUE(q_pos.has_value() == kv_pos.has_value(),
                    "cplib.decode_sdpa: ", q_pos ? "kv_positions" : "q_positions",
                    " is missing: give q_positions and kv_positions together, or neither");
  check_positions(q_pos, "q_positions", q.size(2), "q");
  check_positions(kv_pos, "kv_positions", k.size(2), "k/v");
  CPLIB_CHECK_VALUE(!window || q_pos,
                    "cplib.decode_sdpa: window needs q_positions and "
                    "kv_positions");
  if (window) {
    CPLIB_CHECK_VALUE(window->size() == 2 && (*window)[0] >= 0 && (*window)[1] >= 0,
                      "cplib.decode_sdpa: window must be (left, right), non-negative");
  }
  CPLIB_CHECK_VALUE(!scale || (std::isfinite(*scale) && *scale > 0.0),
                    "cplib.decode_sdpa: scale=", scale ? *scale : 0.0,
                    " must be a finite positive number or None");
}

// What every rank must agree on: q's shape and dtype (its values are
// replicated by contract: comparing them would read q back from the GPU at
// every generated token), the cache's heads and head dims, the mask and the
// scale.
void describe(CallSignature& sig, const Tensor& q, const Tensor& k, const Tensor& v,
              const std::optional<Tensor>& q_pos, const std::optional<std::vector<int64_t>>& window,
              std::optional<double> scale) {
  sig.add_meta("q", q);
  sig.add_meta("k", k, /*skip_dim=*/2);
  sig.add_meta("v", v, /*skip_dim=*/2);
  sig.add_flag("q_positions is not None", q_pos.has_value());
  sig.add_flag("window is not None", window.has_value());
  for (size_t i = 0; window && i < window->size(); ++i)
    sig.add("window[" + std::to_string(i) + "]", (*window)[i]);
  sig.add_optional_float("scale", scale);
}

// The mask of the T queries against this rank's L keys, built on q's device
// from the positions without reading them on the host (no wait for the GPU
// per token): query i sees key j iff kv_pos[j] <= q_pos[i] and, with a
// window, kv_pos[j] >= q_pos[i] - left. Returns the additive (T, L) mask in
// q's dtype and the (T) rows that see no key.
std::pair<Tensor, Tensor> decode_mask(const Tensor& q, const Tensor& q_pos, const Tensor& kv_pos,
                                      const std::optional<std::vector<int64_t>>& window) {
  const Device dev = q.device();
  const Tensor qp = aten::reshape(aten::on_device(q_pos, dev), {q_pos.numel(), 1});
  const Tensor kp = aten::reshape(aten::on_device(kv_pos, dev), {1, kv_pos.numel()});
  Tensor visible = aten::le(kp, qp);
  if (window) {
    // In float64 (ATen's integer subtraction takes no float alpha through
    // the stable call): exact for positions below 2**53, and a window wider
    // than that hides nothing.
    const double left = std::min(static_cast<double>((*window)[0]), 9007199254740992.0);
    const Tensor lo = aten::subtract(aten::to(qp, ScalarType::Double),
                                     aten::full({}, left, aten::Opts{ScalarType::Double, dev}));
    visible = aten::logical_and(visible, aten::ge(aten::to(kp, ScalarType::Double), lo));
  }
  const Tensor additive = aten::where_scalars(
      visible, 0.0, -std::numeric_limits<double>::infinity(), aten::opts_of(q));
  return {additive, aten::logical_not(aten::any_dim(visible, 1))};
}

std::tuple<Tensor, Tensor> decode_sdpa(Tensor q, Tensor k, Tensor v, std::string group_name,
                                       std::optional<Tensor> q_positions,
                                       std::optional<Tensor> kv_positions,
                                       std::optional<std::vector<int64_t>> window,
                                       std::optional<double> scale) {
  aten::NoGradGuard no_grad;
  const Group group = resolve_group(group_name);
  attention::BlockConfig cfg;
  Handshake hs("decode_sdpa");
  hs.validate([&] {
    check_args(q, k, v, q_positions, kv_positions, window, scale);
    describe(hs.sig(), q, k, v, q_positions, window, scale);
    // The block's checks and backend here, so that an error joins the handshake.
    if (k.size(2) > 0)
      cfg = attention::check_local_args("decode_sdpa", q, k, v, false, scale,
                                        attention::kBackendAuto);
    hs.set_lengths({k.size(2)});
  });
  hs.exchange(group);

  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), Dv = v.size(3), L = k.size(2);
  const aten::Opts acc_opts = aten::opts_of(q).dtype_(attention::acc_dtype(q));
  const double ninf = -std::numeric_limits<double>::infinity();
  // This rank's partial, packed as (B, H, T, Dv + 1): out, then lse.
  Tensor packed = aten::empty({B, H, T, Dv + 1}, acc_opts);
  Tensor part_out = aten::narrow(packed, 3, 0, Dv), part_lse = torch::stable::select(packed, 3, Dv);
  if (L == 0) {
    aten::zero_(part_out);
    aten::fill_(part_lse, ninf);
  } else {
    Tensor mask, no_key;
    if (q_positions) std::tie(mask, no_key) = decode_mask(q, *q_positions, *kv_positions, window);
    // GQA without expanding k/v: the q heads of one group become rows of
    // their k/v head, (B, Hkv, groups * T, D), rows ordered (group, token).
    const int64_t G = cfg.groups, Hkv = k.size(1);
    const Tensor qg = aten::reshape(q, {B, Hkv, G * T, q.size(3)});
    const Tensor mg = mask.defined() && G > 1 ? aten::repeat(mask, {G, 1}) : mask;
    cfg.groups = 1;
    cfg.masked_call = mask.defined();
    attention::BlockResult r = attention::block_forward(cfg, qg, k, v, /*causal=*/false, mg);
    Tensor o = aten::reshape(r.out, {B, H, T, Dv}), l = aten::reshape(r.lse, {B, H, T});
    if (mask.defined()) {
      // Rows that see no key here contribute nothing (lse -inf in the merge).
      o = aten::masked_fill(o, aten::view(no_key, {-1, 1}), 0.0);
      l = aten::masked_fill(l, no_key, ninf);
    }
    aten::copy_(part_out, o);
    aten::copy_(part_lse, l);
  }
  const int64_t n = group.size;
  Tensor all;
  if (n > 1) {
    all = all_gather_dim0(group, aten::flat(packed));
    wait(all);
  } else {
    all = aten::flat(packed);
  }
  // Merged in rank order on every rank: the same bits everywhere.
  const Tensor parts = aten::view(all, {n, B, H, T, Dv + 1});
  auto part = [&parts](int64_t r) { return torch::stable::select(parts, 0, r); };
  Tensor out = aten::contiguous(aten::narrow(part(0), 3, 0, Dv));
  Tensor lse = aten::contiguous(torch::stable::select(part(0), 3, Dv));
  for (int64_t r = 1; r < n; ++r)
    merge_partial(out, lse, aten::narrow(part(r), 3, 0, Dv), torch::stable::select(part(r), 3, Dv),
                  0);
  if (out.scalar_type() != q.scalar_type()) out = aten::to(out, q.scalar_type());
  return {out, lse};
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(cplib_c, m) {
  m.def(
      "decode_sdpa(Tensor q, Tensor k, Tensor v, str group_name, Tensor? q_positions=None, "
      "Tensor? kv_positions=None, int[]? window=None, float? scale=None) "
      "-> (Tensor out, Tensor lse)");
}

STABLE_TORCH_LIBRARY_IMPL(cplib_c, CPU, m) { m.impl("decode_sdpa", CPLIB_BOX(&decode_sdpa)); }

#ifdef CPLIB_WITH_CUDA
STABLE_TORCH_LIBRARY_IMPL(cplib_c, CUDA, m) { m.impl("decode_sdpa", CPLIB_BOX(&decode_sdpa)); }
#endif

}  // namespace cplib::decode
