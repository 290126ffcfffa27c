// cplib_c::ring_plan_summary: what the ring's planner (RingPlan, built from
// a Config laid out by lay_out, as check_args lays out the ring's) plans for
// every rank of a ring: per step the offset, whether the rank receives and
// sends a block, the rows that travel, and its calls with their kind and
// rows x keys. No tensors, no communication: cplib's cost model
// (cplib/strategy/plan.py) prices this, so that it counts what the ring does.
#include "common/errors.h"
#include "ring/ring.h"
#include "ring/ring_plan.h"

namespace cplib::ring {
namespace {

constexpr const char* kOp = "ring_plan_summary";

// Flat: [N, local rows of ranks 0..N-1], then per rank [steps], then per
// step [offset, receives, sends, rows received, rows sent, calls], then per
// call [kind (1 full, 2 causal, 3 partial), q rows, k rows].
// `layout` and `rotate` by name, as the ring takes them (ring_call.h).
std::vector<int64_t> ring_plan_summary_op(int64_t seq_len, int64_t world_size, bool is_causal,
                                          std::string layout,
                                          std::optional<std::vector<int64_t>> cu_seqlens,
                                          std::optional<std::vector<int64_t>> window,
                                          std::string rotate) {
  CPLIB_CHECK_VALUE(world_size >= 1, "cplib.", kOp, ": world_size must be >= 1, got ", world_size);
  CPLIB_CHECK_VALUE(seq_len >= world_size, "cplib.", kOp, ": seq_len=", seq_len,
                    " is shorter than the world size ", world_size);
  Config cfg;
  cfg.size = world_size;
  cfg.causal = is_causal;
  cfg.layout = parse_layout(kOp, layout);
  cfg.rotate = parse_rotate(kOp, rotate);
  const bool documented = cfg.layout == SeqLayout::per_document ||
                          cfg.layout == SeqLayout::placement;
  CPLIB_CHECK_VALUE(!documented || cu_seqlens, "cplib.", kOp, ": layout='", layout,
                    "' needs cu_seqlens");
  if (cu_seqlens) {
    check_bounds(kOp, *cu_seqlens, seq_len);
    cfg.mask.bounds = *cu_seqlens;
  }
  lay_out(kOp, cfg, seq_len, seq_len, window);
  std::vector<int64_t> out{world_size};
  for (int64_t r = 0; r < world_size; ++r) out.push_back(cfg.kv_layout.local_len(r));
  for (int64_t r = 0; r < world_size; ++r) {
    cfg.rank = r;
    const RingPlan plan(cfg);
    out.push_back(plan.steps());
    for (int64_t s = 0; s < plan.steps(); ++s) {
      const std::vector<Call>& calls = plan.calls(s);
      out.insert(out.end(),
                 {plan.offset(s), plan.receives(s), s > 0 && plan.sends(s), plan.recv_len(s),
                  plan.send_len(s), static_cast<int64_t>(calls.size())});
      for (const Call& c : calls)
        out.insert(out.end(), {static_cast<int64_t>(c.kind), c.q_len, c.k_len});
    }
  }
  return out;
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(cplib_c, m) {
  m.def(
      "ring_plan_summary(int seq_len, int world_size, bool is_causal, str layout, "
      "int[]? cu_seqlens, int[]? window, str rotate) -> int[]");
}

// No tensor arguments: CompositeExplicitAutograd.
STABLE_TORCH_LIBRARY_IMPL(cplib_c, CompositeExplicitAutograd, m) {
  m.impl("ring_plan_summary", CPLIB_BOX(&ring_plan_summary_op));
}

}  // namespace cplib::ring
