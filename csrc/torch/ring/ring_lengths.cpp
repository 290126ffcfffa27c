#include "ring/ring_lengths.h"

#include <algorithm>
#include <sstream>

#include <torch/library.h>

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

}  // namespace

std::vector<int64_t> gather_local_lengths(const PG& pg, const std::vector<int64_t>& local,
                                          const at::Device& device) {
  const int64_t n = pg->getSize(), w = static_cast<int64_t>(local.size());
  if (n == 1 || w == 0) return local;
  at::Tensor in = at::tensor(local, at::TensorOptions().dtype(at::kLong)).to(device);
  at::Tensor out = at::empty({n * w}, in.options());
  wait(all_gather_dim0(pg, out, in));
  const at::Tensor host = out.cpu();
  const int64_t* p = host.data_ptr<int64_t>();
  return {p, p + n * w};
}

void learn_local_lengths(const char* op, Config& cfg, const at::Tensor& q, const at::Tensor& k,
                         const Extras& ex, const Handshake& hs) {
  if (ex.seq_len || ex.per_document || cfg.size == 1) return;
  const int64_t n = cfg.size;
  std::vector<int64_t> lq(n), lk(n);
  if (hs.exchanged()) {
    for (int64_t r = 0; r < n; ++r) {
      const std::vector<int64_t> mine = hs.lengths(r);  // {q rows, k/v rows}
      lq[r] = mine.at(0), lk[r] = mine.at(1);
    }
  } else {
    const std::vector<int64_t> table =
        gather_local_lengths(cfg.pg, {q.size(2), k.size(2)}, q.device());
    for (int64_t r = 0; r < n; ++r) lq[r] = table[2 * r], lk[r] = table[2 * r + 1];
  }
  if (all_equal(lq) && all_equal(lk)) return;
  const bool positional = cfg.causal || cfg.load_balanced || ex.cu_seqlens || ex.window;
  TORCH_CHECK_VALUE(!positional, "cplib.", op, ": the ranks' local lengths differ (q ", list(lq),
                    ", k/v ", list(lk), "), which only non-causal attention without documents, "
                    "windows or load balancing accepts; pass seq_len for a layout cplib derives");
  cfg.q_layout = {0, n, false, {}, lq, {}};
  cfg.kv_layout = {0, n, false, {}, lk, {}};
  for (int64_t r = 0; r < n; ++r) cfg.q_layout.seq_len += lq[r], cfg.kv_layout.seq_len += lk[r];
  Mask& m = cfg.mask;
  m.seq_len = std::max(cfg.q_layout.seq_len, cfg.kv_layout.seq_len);
  m.left = m.right = m.seq_len;
}

namespace {

std::vector<int64_t> gather_local_lengths_op(at::IntArrayRef local, c10::string_view group_name,
                                             at::Device device) {
  return gather_local_lengths(resolve_group({group_name.data(), group_name.size()}), local.vec(),
                              device);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cplib_c, m) {
  // Not traceable (its result is data): eager entry points only.
  m.def("gather_local_lengths(int[] local, str group_name, Device device) -> int[]",
        &gather_local_lengths_op);
}

}  // namespace cplib::ring
