#include "ring/ring_lengths.h"

#include <algorithm>
#include <sstream>

#include "comm/handshake.h"
#include "common/aten.h"

namespace cplib::ring {
namespace {

std::string list(const std::vector<int64_t>& v) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
  os << "]";
  return os.str();
}

bool all_equal(const std::vector<int64_t>& v) {
  for (const int64_t x : v)
    if (x != v.front()) return false;
  return true;
}

// Self-attention over a sequential or head-tail layout of any length
// (cplib's any-length shards, as _ContextParallel modules get them from
// _context_parallel_shard): S is the sum of the ranks' lengths, and the layout
// of S is the one whose shards they are. Lays it out and returns true then.
bool derive_layout(const char* op, Config& cfg, const RingCall& call,
                   const std::vector<int64_t>& lq, const std::vector<int64_t>& lk) {
  const bool derivable = lq == lk && !call.cu_seqlens &&
                         (cfg.layout == SeqLayout::sequential ||
                          cfg.layout == SeqLayout::head_tail);
  if (!derivable) return false;
  int64_t s = 0;
  for (const int64_t l : lq) s += l;
  lay_out(op, cfg, s, s, call.window);
  for (int64_t r = 0; r < cfg.size; ++r)
    if (cfg.q_layout.local_len(r) != lq[static_cast<size_t>(r)]) return false;
  return true;
}

}  // namespace

std::vector<int64_t> gather_local_lengths(const Group& group, const std::vector<int64_t>& local,
                                          const Device& device) {
  const int64_t n = group.size, w = static_cast<int64_t>(local.size());
  if (n == 1 || w == 0) return local;
  // In host memory where the group (or its handshake side group) takes CPU
  // tensors: no wait for the GPU; `device` only for a group that does not.
  const HandshakeRoute route = handshake_route(group);
  const Device on = route.device.type() == DeviceType::CPU ? route.device : device;
  const Tensor out = all_gather_dim0(route.via, aten::from_host(local, on));
  wait(out);
  return aten::to_host(out);
}

void learn_local_lengths(const char* op, Config& cfg, const Tensor& q, const Tensor& k,
                         const RingCall& call, std::vector<int64_t>& table) {
  if (call.seq_len || call.layout == SeqLayout::per_document || cfg.size == 1) {
    table.clear();
    return;
  }
  const int64_t n = cfg.size;
  if (static_cast<int64_t>(table.size()) != 2 * n)
    table = gather_local_lengths(cfg.group, {q.size(2), k.size(2)}, q.device());
  std::vector<int64_t> lq(n), lk(n);
  for (int64_t r = 0; r < n; ++r) lq[r] = table[2 * r], lk[r] = table[2 * r + 1];
  if (all_equal(lq) && all_equal(lk)) return;
  if (derive_layout(op, cfg, call, lq, lk)) return;
  const bool positional = cfg.causal || cfg.layout != SeqLayout::sequential || call.cu_seqlens ||
                          call.window;
  CPLIB_CHECK_VALUE(!positional, "cplib.", op, ": the ranks' local lengths differ (q ", list(lq),
                    ", k/v ", list(lk),
                    "), and are not the sequential or head-tail shards of one sequence, which "
                    "causal attention, documents, windows and load balancing need (cplib.shard "
                    "and _context_parallel_shard cut any length so); pass seq_len for a layout "
                    "cplib derives");
  cfg.q_layout = {0, n, false, {}, lq, {}, {}};
  cfg.kv_layout = {0, n, false, {}, lk, {}, {}};
  for (int64_t r = 0; r < n; ++r) cfg.q_layout.seq_len += lq[r], cfg.kv_layout.seq_len += lk[r];
  Mask& m = cfg.mask;
  m.seq_len = std::max(cfg.q_layout.seq_len, cfg.kv_layout.seq_len);
  m.left = m.right = m.seq_len;
}

namespace {

std::vector<int64_t> gather_local_lengths_op(std::vector<int64_t> local, std::string group_name,
                                             Device device) {
  return gather_local_lengths(resolve_group(group_name), local, device);
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(cplib_c, m) {
  // Not traceable (its result is data): eager entry points only.
  m.def("gather_local_lengths(int[] local, str group_name, Device device) -> int[]");
}

// No tensor arguments: CompositeExplicitAutograd.
STABLE_TORCH_LIBRARY_IMPL(cplib_c, CompositeExplicitAutograd, m) {
  m.impl("gather_local_lengths", CPLIB_BOX(&gather_local_lengths_op));
}

}  // namespace cplib::ring
