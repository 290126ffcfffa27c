// Argument validation of the ring ops: every check runs before any
// communication and reads nothing another rank could see differently, except
// cu_seqlens (the same on every rank by contract).
#include <algorithm>
#include <array>
#include <sstream>

#include "attention/checks.h"
#include "common/aten.h"
#include "common/checks.h"
#include "common/format.h"
#include "ring/ring.h"
#include "ring/ring_placement.h"

namespace cplib::ring {

namespace {

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

}  // namespace

void check_bounds(const char* op, const std::vector<int64_t>& b, int64_t seq_len) {
  CPLIB_CHECK_VALUE(b.size() >= 2, "cplib.", op,
                    ": cu_seqlens must have at least 2 entries "
                    "[0, ..., S], got ",
                    join(b));
  CPLIB_CHECK_VALUE(b.front() == 0, "cplib.", op, ": cu_seqlens must start at 0, got ", b.front(),
                    " in ", join(b));
  CPLIB_CHECK_VALUE(b.back() == seq_len, "cplib.", op,
                    ": cu_seqlens must end at the sequence "
                    "length ",
                    seq_len, ", got ", b.back(), " in ", join(b));
  for (size_t i = 1; i < b.size(); ++i)
    CPLIB_CHECK_VALUE(b[i] > b[i - 1], "cplib.", op,
                      ": cu_seqlens must be strictly increasing, "
                      "got ",
                      b[i - 1], " then ", b[i], " at index ", i, " in ", join(b));
}

namespace {

// cu_seqlens as host integers (read once, RingCall), checked: [0, ..., S],
// strictly increasing.
const std::vector<int64_t>& document_bounds(const char* op, const RingCall& call, int64_t seq_len) {
  const Tensor& cu = *call.cu_seqlens;
  CPLIB_CHECK_VALUE(is_integer(cu.scalar_type()), "cplib.", op,
                    ": cu_seqlens must be an integer tensor, got dtype ", cu.scalar_type());
  CPLIB_CHECK_VALUE(cu.dim() == 1 && cu.numel() >= 2, "cplib.", op,
                    ": cu_seqlens must be 1-D with at least 2 entries [0, ..., S], got shape ",
                    cu.sizes());
  const std::vector<int64_t>& b = call.cu_seqlens_values();
  check_bounds(op, b, seq_len);
  return b;
}

// Explicit positions: 1-D integers, one per row, non-negative, inside the
// documents if any. Reads only this rank's values (once, RingCall).
void check_positions(const char* op, const char* name, const std::optional<Tensor>& pos,
                     const std::vector<int64_t>& (RingCall::*values)() const, const RingCall& call,
                     int64_t rows, const char* rows_of) {
  CPLIB_CHECK_VALUE(pos.has_value(), "cplib.", op, ": ", name,
                    " is missing: give q_positions and kv_positions together, or neither");
  const Tensor& p = *pos;
  CPLIB_CHECK_VALUE(is_integer(p.scalar_type()), "cplib.", op, ": ", name,
                    " must be an integer tensor, got dtype ", p.scalar_type());
  CPLIB_CHECK_VALUE(p.dim() == 1, "cplib.", op, ": ", name,
                    " must be 1-D (one global position per row), got shape ", p.sizes());
  CPLIB_CHECK_VALUE(p.numel() == rows, "cplib.", op, ": ", name, " has ", p.numel(),
                    " positions but ", rows_of, " has ", rows, " rows");
  if (rows > 0) {
    const std::vector<int64_t>& v = (call.*values)();
    const int64_t lo = *std::min_element(v.begin(), v.end());
    CPLIB_CHECK_VALUE(lo >= 0, "cplib.", op, ": ", name, " must be non-negative, got ", lo);
  }
}

// cu_seqlens' last entry (its shape checked), from the values read once.
int64_t documents_end(const char* op, const RingCall& call) {
  const Tensor& cu = *call.cu_seqlens;
  CPLIB_CHECK_VALUE(cu.dim() == 1 && cu.numel() >= 2, "cplib.", op,
                    ": cu_seqlens must be 1-D with at least 2 entries [0, ..., S], got shape ",
                    cu.sizes());
  CPLIB_CHECK_VALUE(is_integer(cu.scalar_type()), "cplib.", op,
                    ": cu_seqlens must be an integer tensor, got dtype ", cu.scalar_type());
  return call.cu_seqlens_values().back();
}

void check_explicit(const char* op, const Tensor& q, const Tensor& k, const RingCall& call) {
  check_positions(op, "q_positions", call.q_positions, &RingCall::q_positions_values, call,
                  q.size(2), "q");
  check_positions(op, "kv_positions", call.kv_positions, &RingCall::kv_positions_values, call,
                  k.size(2), "k/v");
  CPLIB_CHECK_VALUE(call.layout == SeqLayout::sequential && !call.seq_len, "cplib.", op,
                    ": q_positions/kv_positions describe the layout themselves: they exclude "
                    "seq_len and layout='",
                    kLayoutNames[static_cast<size_t>(call.layout)],
                    "' (load_balanced, per_document and placement)");
  if (call.cu_seqlens) {
    const int64_t end = documents_end(op, call);
    for (const bool is_q : {true, false}) {
      const std::vector<int64_t>& v = is_q ? call.q_positions_values() : call.kv_positions_values();
      if (v.empty()) continue;
      const int64_t hi = *std::max_element(v.begin(), v.end());
      CPLIB_CHECK_VALUE(hi < end, "cplib.", op, ": ", is_q ? "q_positions" : "kv_positions",
                        " holds ", hi, ", past the last document (cu_seqlens ends at ", end, ")");
    }
  }
}

// Layouts and mask from the optional arguments.
void check_extras(const char* op, Config& cfg, const Tensor& q, const Tensor& k,
                  const RingCall& call) {
  const int64_t n = cfg.size, lq = q.size(2), lk = k.size(2);
  int64_t sq = lq * n, sk = lk * n;
  if (call.seq_len) {
    const int64_t s = *call.seq_len;
    CPLIB_CHECK_VALUE(s >= n, "cplib.", op, ": seq_len=", s, " is shorter than the world size ", n,
                      " (every rank needs a token)");
    sq = sk = s;
  }
  if (call.has_positions()) {
    check_explicit(op, q, k, call);
    if (call.cu_seqlens) sq = sk = documents_end(op, call);
  }
  const bool masked = call.cu_seqlens.has_value() || call.window.has_value();
  CPLIB_CHECK_VALUE(!masked || sq == sk || call.has_positions(), "cplib.", op,
                    ": cu_seqlens and window need q and k/v of one global length, got q ", sq,
                    " and kv ", sk);
  const bool documented = call.layout == SeqLayout::per_document ||
                          call.layout == SeqLayout::placement;
  CPLIB_CHECK_VALUE(call.layout != SeqLayout::per_document || (call.cu_seqlens && call.seq_len),
                    "cplib.", op,
                    ": per_document=True (head-tail inside every document) needs "
                    "cu_seqlens and seq_len");
  CPLIB_CHECK_VALUE(call.layout != SeqLayout::placement || (call.cu_seqlens && call.seq_len),
                    "cplib.", op,
                    ": placement=True (documents placed across the ranks) needs "
                    "cu_seqlens and seq_len");
  if (call.cu_seqlens) cfg.mask.bounds = document_bounds(op, call, sq);
  lay_out(op, cfg, sq, sk, call.window);
  if (call.seq_len || documented) {
    static constexpr std::array<const char*, 4> kWords{
        "sequential", "head-tail", "per-document head-tail", "document placement"};
    const int64_t want = cfg.q_layout.local_len(cfg.rank);
    CPLIB_CHECK_VALUE(lq == want && lk == want, "cplib.", op, ": seq_len=", sq, " over ", n,
                      " ranks (", kWords[static_cast<size_t>(cfg.layout)], " layout) gives rank ",
                      cfg.rank, " ", want, " rows, but q has ", lq, " and k/v ", lk);
  }
}

}  // namespace

void lay_out(const char* op, Config& cfg, int64_t sq, int64_t sk,
             const std::optional<std::vector<int64_t>>& window) {
  const int64_t n = cfg.size;
  Mask& m = cfg.mask;
  const bool head_tail = cfg.layout == SeqLayout::head_tail;
  cfg.q_layout = {sq, n, head_tail, {}, {}, {}, {}};
  cfg.kv_layout = {sk, n, head_tail, {}, {}, {}, {}};
  if (cfg.layout == SeqLayout::per_document)
    cfg.q_layout.documents = cfg.kv_layout.documents = m.bounds;
  if (cfg.layout == SeqLayout::placement)
    cfg.q_layout.placed = cfg.kv_layout.placed = document_placement(m.bounds, n);
  m.causal = cfg.causal;
  m.seq_len = std::max(sq, sk);
  m.left = m.right = m.seq_len;
  if (window) {
    const auto& w = *window;
    CPLIB_CHECK_VALUE(w.size() == 2, "cplib.", op, ": window must be (left, right), got ", join(w));
    CPLIB_CHECK_VALUE(w[0] >= 0 && w[1] >= 0, "cplib.", op, ": window=", join(w),
                      " must be non-negative (None for no limit)");
    m.left = std::min(w[0], m.seq_len);
    m.right = std::min(w[1], m.seq_len);
  }
  if (cfg.causal) m.right = 0;
}

Config check_args(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                  const Group& group, const RingCall& call) {
  CPLIB_CHECK_VALUE(call.unknown.empty(), "cplib.", op, ": ", call.unknown);
  Config cfg;
  static_cast<attention::BlockConfig&>(cfg) = attention::check_block_args(
      op, q, k, v, call.causal, call.scale, call.backend, call.has_positions());
  // Without seq_len the global length is N times the local one (the sum of
  // the ranks' lengths where they differ: learn_local_lengths); an odd one
  // cuts head-tail into chunks within a row of each other, which give every
  // rank the same length (S = N * L odd: the first N of 2N chunks get the
  // extra row, one per rank).
  cfg.group = group;
  cfg.rank = cfg.group.rank;
  cfg.size = cfg.group.size;
  cfg.layout = call.layout;
  cfg.rotate = call.rotate;
  check_extras(op, cfg, q, k, call);
  // What one process would give SDPA as attn_mask (the any-length padding
  // is not: that call is plain causal or full).
  cfg.masked_call = call.cu_seqlens.has_value() || call.window.has_value() || call.has_positions();
  return cfg;
}

bool pass_q_moves_less(int64_t q_tokens, int64_t kv_tokens, int64_t q_heads, int64_t kv_heads,
                       int64_t head_dim, int64_t v_head_dim, int64_t elem_size, int64_t acc_size) {
  // pass-KV: every k/v row travels; pass-Q: every q row travels and its
  // partial out and lse (accumulator dtype) come back.
  const double kv = static_cast<double>(kv_tokens) * kv_heads * (head_dim + v_head_dim) * elem_size;
  const double qb = static_cast<double>(q_tokens) * q_heads *
                    (head_dim * elem_size + (v_head_dim + 1) * acc_size);
  return qb < kv;
}

}  // namespace cplib::ring
