#include "ring/ring_agreed.h"

#include <algorithm>
#include <atomic>

#include "attention/block.h"
#include "common/aten.h"
#include "ring/ring_lengths.h"

namespace cplib::ring {
namespace {

std::atomic<Pass> g_last_pass{Pass::kv};
// What the last finish_config of this thread resolved its backend from.
thread_local std::vector<int64_t> t_last_shape;

constexpr int64_t kRecordMagic = 0x63706c6961677232;  // "cplagr2"

void put(std::vector<int64_t>& out, const std::vector<int64_t>& v) {
  out.push_back(static_cast<int64_t>(v.size()));
  out.insert(out.end(), v.begin(), v.end());
}

// Reads a record written by Agreed::to_record, refusing anything else.
class Reader {
 public:
  Reader(const int64_t* p, int64_t n) : p_(p), end_(p + n) {}
  int64_t next() {
    check(1);
    return *p_++;
  }
  std::vector<int64_t> list() {
    const int64_t n = next();
    check(n);
    std::vector<int64_t> v(p_, p_ + n);
    p_ += n;
    return v;
  }

 private:
  void check(int64_t n) const {
    CPLIB_CHECK_VALUE(n >= 0 && n <= end_ - p_,
                      "cplib.ring_sdpa_backward_covered: the agreed "
                      "record is cut short (it is internal: made by ring_sdpa's forward)");
  }
  const int64_t* p_;
  const int64_t* end_;
};

// Every rank's explicit positions: one all-gather in host memory of each
// rank's [q positions | k/v positions], each padded to the longest.
void gather_positions(Config& cfg, const RingCall& call, const Tensor& q, const Tensor& k,
                      std::vector<int64_t> lengths) {
  const int64_t n = cfg.size;
  if (static_cast<int64_t>(lengths.size()) != 2 * n)
    lengths = gather_local_lengths(cfg.group, {q.size(2), k.size(2)}, q.device());
  int64_t wq = 1, wk = 1;
  for (int64_t r = 0; r < n; ++r)
    wq = std::max(wq, lengths[2 * r]), wk = std::max(wk, lengths[2 * r + 1]);
  std::vector<int64_t> mine(wq + wk, -1);
  const std::vector<int64_t>& qp = call.q_positions_values();
  const std::vector<int64_t>& kp = call.kv_positions_values();
  std::copy(qp.begin(), qp.end(), mine.begin());
  std::copy(kp.begin(), kp.end(), mine.begin() + wq);
  const std::vector<int64_t> all = gather_local_lengths(cfg.group, mine, q.device());
  Layout ql, kl;
  ql.size = kl.size = n;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t* row = all.data() + r * (wq + wk);
    ql.positions.emplace_back(row, row + lengths[2 * r]);
    kl.positions.emplace_back(row + wq, row + wq + lengths[2 * r + 1]);
  }
  cfg.q_layout = std::move(ql);
  cfg.kv_layout = std::move(kl);
}

}  // namespace

Tensor Agreed::to_record() const {
  std::vector<int64_t> r{kRecordMagic, rank, size, nccl, token, backend, has_bounds ? 1 : 0};
  put(r, lengths);
  put(r, bounds);
  r.push_back(static_cast<int64_t>(q_positions.size()));
  for (size_t i = 0; i < q_positions.size(); ++i) {
    put(r, q_positions[i]);
    put(r, kv_positions[i]);
  }
  // One allocation, filled on the host (no copy through the dispatcher).
  Tensor record = aten::empty({static_cast<int64_t>(r.size())},
                              aten::Opts{ScalarType::Long, Device(DeviceType::CPU)});
  std::copy(r.begin(), r.end(), static_cast<int64_t*>(record.mutable_data_ptr()));
  return record;
}

Agreed Agreed::from_record(const Tensor& record) {
  CPLIB_CHECK_VALUE(record.device().type() == DeviceType::CPU &&
                        record.scalar_type() == ScalarType::Long && record.dim() == 1 &&
                        record.is_contiguous(),
                    "cplib.ring_sdpa_backward_covered: agreed must be the 1-D int64 CPU record "
                    "ring_sdpa's forward made (an internal op)");
  Reader in(record.const_data_ptr<int64_t>(), record.numel());
  CPLIB_CHECK_VALUE(in.next() == kRecordMagic,
                    "cplib.ring_sdpa_backward_covered: agreed is not "
                    "a record of ring_sdpa's forward (an internal op)");
  Agreed a;
  a.rank = in.next();
  a.size = in.next();
  a.nccl = in.next();
  a.token = in.next();
  a.backend = in.next();
  a.has_bounds = in.next() != 0;
  a.lengths = in.list();
  a.bounds = in.list();
  const int64_t ranks = in.next();
  for (int64_t r = 0; r < ranks; ++r) {
    a.q_positions.push_back(in.list());
    a.kv_positions.push_back(in.list());
  }
  return a;
}

attention::BlockShape ring_block_shape(const Config& cfg, const Tensor& q, const Tensor& k,
                                       const Tensor& v) {
  attention::BlockShape s;
  s.batch = q.size(0);
  s.heads = q.size(1);
  s.q_len = std::max<int64_t>(1, cfg.q_layout.max_local_len());
  s.kv_len = std::max<int64_t>(1, cfg.kv_layout.max_local_len());
  s.head_dim = k.size(3);
  s.v_head_dim = v.size(3);
  return s;
}

int64_t resolve_ring_backend(const Config& cfg, const Tensor& q, const Tensor& k, const Tensor& v) {
  if (!cfg.cuda || cfg.backend != attention::kBackendAuto) return cfg.backend;
  // Causal calls run on the diagonal of equal layouts; explicit positions mask instead.
  const bool causal = cfg.causal && !cfg.q_layout.is_explicit();
  return attention::resolve_backend_cuda(cfg.backend, q, ring_block_shape(cfg, q, k, v), causal,
                                         cfg.scale);
}

std::vector<int64_t> last_block_shape() { return t_last_shape; }

void finish_config(Config& cfg, const RingCall& call, const Tensor& q, const Tensor& k,
                   const Tensor& v, std::vector<int64_t> lengths, const Agreed* agreed) {
  if (call.has_positions()) {
    if (agreed) {
      cfg.q_layout = Layout{};
      cfg.kv_layout = Layout{};
      cfg.q_layout.size = cfg.kv_layout.size = cfg.size;
      cfg.q_layout.positions = agreed->q_positions;
      cfg.kv_layout.positions = agreed->kv_positions;
    } else {
      gather_positions(cfg, call, q, k, std::move(lengths));
    }
    int64_t top = 0;
    for (const Layout* l : {&cfg.q_layout, &cfg.kv_layout})
      for (const auto& p : l->positions)
        for (const int64_t x : p) top = std::max(top, x + 1);
    Mask& m = cfg.mask;
    m.seq_len = std::max<int64_t>({top, m.bounds.empty() ? 0 : m.bounds.back(), 1});
    m.left = m.right = m.seq_len;
    if (call.window) {
      m.left = std::min((*call.window)[0], m.seq_len);
      m.right = std::min((*call.window)[1], m.seq_len);
    }
    if (cfg.causal) m.right = 0;
  }
  const attention::BlockShape s = ring_block_shape(cfg, q, k, v);
  t_last_shape = {s.batch, s.heads, s.q_len, s.kv_len, s.head_dim, s.v_head_dim};
  cfg.backend = agreed ? agreed->backend : resolve_ring_backend(cfg, q, k, v);
  Pass pass = call.ring_pass;
  if (pass == Pass::fewer_bytes) {
    int64_t tq = 0, tk = 0;
    for (int64_t r = 0; r < cfg.size; ++r)
      tq += cfg.q_layout.local_len(r), tk += cfg.kv_layout.local_len(r);
    pass = pass_q_moves_less(tq, tk, q.size(1), k.size(1), q.size(3), v.size(3),
                             static_cast<int64_t>(q.element_size()),
                             attention::acc_dtype(q) == ScalarType::Double ? 8 : 4)
               ? Pass::q
               : Pass::kv;
  }
  cfg.pass_q = pass == Pass::q;
  g_last_pass = pass;
}

Pass last_ring_pass() { return g_last_pass.load(); }

Agreed agreed_of(const Config& cfg, const RingCall& call, std::vector<int64_t> lengths) {
  Agreed a;
  a.rank = cfg.group.rank;
  a.size = cfg.group.size;
  a.nccl = cfg.group.nccl ? 1 : 0;
  a.token = cfg.group.token;
  a.backend = cfg.backend;
  a.lengths = std::move(lengths);
  a.has_bounds = call.cu_seqlens.has_value();
  a.bounds = cfg.mask.bounds;
  if (cfg.q_layout.is_explicit()) {
    a.q_positions = cfg.q_layout.positions;
    a.kv_positions = cfg.kv_layout.positions;
  }
  return a;
}

}  // namespace cplib::ring
