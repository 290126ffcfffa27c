// cplib_c::decode_sdpa: attention of the newest T tokens (q, the same on
// every rank) against a KV cache sharded over the group in any order. Each
// rank attends q to its own shard (masked on positions: causal, optionally
// windowed), then one all-gather of the packed partial (out | lse) and a
// merge in rank order, so every rank ends with the same exact result.
#include <cmath>
#include <limits>

#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/library.h>

#include "comm/handshake.h"
#include "merge/merge_op.h"
#include "ring/ring_block.h"

namespace cplib::decode {
namespace {

using ring::acc_dtype;

void check_positions(const std::optional<at::Tensor>& pos, const char* name, int64_t rows,
                     const char* rows_of) {
  if (!pos) return;
  const at::Tensor& p = *pos;
  TORCH_CHECK_VALUE(!at::isFloatingType(p.scalar_type()) && !at::isComplexType(p.scalar_type()) &&
                        p.scalar_type() != at::kBool,
                    "cplib.decode_sdpa: ", name, " must be an integer tensor, got dtype ",
                    p.scalar_type());
  TORCH_CHECK_VALUE(p.dim() == 1, "cplib.decode_sdpa: ", name,
                    " must be 1-D (one global position per row), got shape ", p.sizes());
  TORCH_CHECK_VALUE(p.numel() == rows, "cplib.decode_sdpa: ", name, " has ", p.numel(),
                    " positions but ", rows_of, " has ", rows, " rows");
}

void check_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                const std::optional<at::Tensor>& q_pos, const std::optional<at::Tensor>& kv_pos,
                const std::optional<std::vector<int64_t>>& window, std::optional<double> scale) {
  TORCH_CHECK_VALUE(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
                    "cplib.decode_sdpa: expected q (B, Hq, T, D) and k, v (B, Hkv, L_local, D), "
                    "got q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  TORCH_CHECK_VALUE(q.device() == k.device() && q.device() == v.device(),
                    "cplib.decode_sdpa: q, k, v must be on one device");
  TORCH_CHECK_VALUE(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
                    "cplib.decode_sdpa: q, k, v must have one dtype, got ", q.scalar_type(), ", ",
                    k.scalar_type(), ", ", v.scalar_type());
  const auto dt = q.scalar_type();
  TORCH_CHECK_VALUE(dt == at::kFloat || dt == at::kDouble || dt == at::kBFloat16 || dt == at::kHalf,
                    "cplib.decode_sdpa: unsupported dtype ", dt);
  TORCH_CHECK_VALUE(q.size(2) >= 1, "cplib.decode_sdpa: q needs at least one token, got T = ",
                    q.size(2));
  TORCH_CHECK_VALUE(q.size(0) == k.size(0) && q.size(0) == v.size(0),
                    "cplib.decode_sdpa: batch sizes differ: q ", q.size(0), ", k ", k.size(0),
                    ", v ", v.size(0));
  TORCH_CHECK_VALUE(k.size(1) == v.size(1) && k.size(2) == v.size(2), "cplib.decode_sdpa: k ",
                    k.sizes(), " and v ", v.sizes(), " must agree in heads and length");
  TORCH_CHECK_VALUE(q.size(3) == k.size(3), "cplib.decode_sdpa: q head dim ", q.size(3),
                    " differs from k head dim ", k.size(3));
  TORCH_CHECK_VALUE(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "cplib.decode_sdpa: q has ",
                    q.size(1), " heads, which is not a multiple of k/v's ", k.size(1), " heads");
  TORCH_CHECK_VALUE(q_pos.has_value() == kv_pos.has_value(), "cplib.decode_sdpa: ",
                    q_pos ? "kv_positions" : "q_positions",
                    " is missing: give q_positions and kv_positions together, or neither");
  check_positions(q_pos, "q_positions", q.size(2), "q");
  check_positions(kv_pos, "kv_positions", k.size(2), "k/v");
  TORCH_CHECK_VALUE(!window || q_pos, "cplib.decode_sdpa: window needs q_positions and "
                    "kv_positions");
  if (window) {
    TORCH_CHECK_VALUE(window->size() == 2 && (*window)[0] >= 0 && (*window)[1] >= 0,
                      "cplib.decode_sdpa: window must be (left, right), non-negative");
  }
  TORCH_CHECK_VALUE(!scale || (std::isfinite(*scale) && *scale > 0.0), "cplib.decode_sdpa: scale=",
                    scale ? *scale : 0.0, " must be a finite positive number or None");
}

// What every rank must agree on: q itself (it is replicated by contract),
// the cache's heads and head dims, the mask and the scale.
void describe(CallSignature& sig, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
              const std::optional<at::Tensor>& q_pos,
              const std::optional<std::vector<int64_t>>& window, std::optional<double> scale) {
  sig.add_meta("q", q);
  sig.add_values_hash("q", q.contiguous().view(-1).view(at::kByte));
  sig.add_meta("k", k, /*skip_dim=*/2);
  sig.add_meta("v", v, /*skip_dim=*/2);
  sig.add_flag("q_positions is not None", q_pos.has_value());
  if (q_pos) sig.add_values_hash("q_positions", *q_pos);
  sig.add_flag("window is not None", window.has_value());
  for (size_t i = 0; window && i < window->size(); ++i)
    sig.add("window[" + std::to_string(i) + "]", (*window)[i]);
  sig.add_optional_float("scale", scale);
}

std::tuple<at::Tensor, at::Tensor> decode_sdpa(const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& v, c10::string_view group_name,
                                               const std::optional<at::Tensor>& q_positions,
                                               const std::optional<at::Tensor>& kv_positions,
                                               at::OptionalIntArrayRef window_arg,
                                               std::optional<double> scale) {
  at::AutoDispatchBelowADInplaceOrView guard;
  std::optional<std::vector<int64_t>> window;
  if (window_arg.has_value()) window = window_arg->vec();
  const std::string_view name{group_name.data(), group_name.size()};
  const PG pg = resolve_group(name);
  Handshake hs("decode_sdpa");
  hs.validate([&] {
    check_args(q, k, v, q_positions, kv_positions, window, scale);
    describe(hs.sig(), q, k, v, q_positions, window, scale);
    hs.set_lengths({k.size(2)});
  });
  hs.exchange(name, pg, q.device());

  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), Dv = v.size(3), L = k.size(2);
  const auto acc_opts = q.options().dtype(acc_dtype(q));
  const double ninf = -std::numeric_limits<double>::infinity();
  // This rank's partial, packed as (B, H, T, Dv + 1): out, then lse.
  at::Tensor packed = at::empty({B, H, T, Dv + 1}, acc_opts);
  at::Tensor part_out = packed.narrow(3, 0, Dv), part_lse = packed.select(3, Dv);
  part_out.zero_();
  part_lse.fill_(ninf);
  if (L > 0) {
    ring::Config cfg = ring::check_local_args("decode_sdpa", q, k, v, false, scale, -1);
    at::Tensor mask, no_key;
    if (q_positions) {
      ring::Mask m;
      m.causal = true;
      const auto idx = q.options().dtype(at::kLong);
      const at::Tensor qp = q_positions->to(idx), kp = kv_positions->to(idx);
      const int64_t top = std::max(qp.max().item<int64_t>(), kp.max().item<int64_t>()) + 1;
      m.seq_len = top;
      m.left = window ? std::min((*window)[0], top) : top;
      m.right = 0;
      std::tie(mask, no_key) = m.build_at(qp, kp, q.options());
      if (!no_key.any().item<bool>() && !mask.ne(0).any().item<bool>()) mask = at::Tensor();
    }
    if (!no_key.defined() || !no_key.all().item<bool>()) {
      // GQA without expanding k/v: the q heads of one group become rows of
      // their k/v head, (B, Hkv, groups * T, D), rows ordered (group, token).
      const int64_t G = cfg.groups, Hkv = k.size(1);
      const at::Tensor qg = q.reshape({B, Hkv, G * T, q.size(3)});
      const at::Tensor mg = mask.defined() && G > 1 ? mask.repeat({G, 1}) : mask;
      cfg.groups = 1;
      ring::BlockResult r = ring::block_forward(cfg, qg, k, v, /*causal=*/false, mg);
      at::Tensor o = r.out.reshape({B, H, T, Dv}), l = r.lse.reshape({B, H, T});
      if (mask.defined()) {
        o = o.masked_fill(no_key.view({-1, 1}), 0);
        l = l.masked_fill(no_key, ninf);
      }
      part_out.copy_(o);
      part_lse.copy_(l);
    }
  }
  const int64_t n = pg->getSize();
  at::Tensor flat = packed.view(-1);
  at::Tensor all = at::empty({n * flat.numel()}, acc_opts);
  if (n > 1) {
    wait(all_gather_dim0(pg, all, flat));
  } else {
    all.copy_(flat);
  }
  // Merged in rank order on every rank: the same bits everywhere.
  const at::Tensor parts = all.view({n, B, H, T, Dv + 1});
  at::Tensor out = parts[0].narrow(3, 0, Dv).contiguous();
  at::Tensor lse = parts[0].select(3, Dv).contiguous();
  for (int64_t r = 1; r < n; ++r)
    merge_partial(out, lse, parts[r].narrow(3, 0, Dv), parts[r].select(3, Dv), 0);
  if (out.scalar_type() != q.scalar_type()) out = out.to(q.scalar_type());
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cplib_c, m) {
  m.def(
      "decode_sdpa(Tensor q, Tensor k, Tensor v, str group_name, Tensor? q_positions=None, "
      "Tensor? kv_positions=None, int[]? window=None, float? scale=None) "
      "-> (Tensor out, Tensor lse)");
}

TORCH_LIBRARY_IMPL(cplib_c, CPU, m) { m.impl("decode_sdpa", &decode_sdpa); }

#ifdef CPLIB_WITH_CUDA
TORCH_LIBRARY_IMPL(cplib_c, CUDA, m) { m.impl("decode_sdpa", &decode_sdpa); }
#endif

}  // namespace cplib::decode
