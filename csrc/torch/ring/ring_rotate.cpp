// Ring rotation: "p2p" posts a send/recv pair per part and step, "alltoall"
// one all-to-all per part whose only non-empty splits are the two
// neighbours, "allgather" gathers every block up front (and reduce-scatters
// gradients at the end).
#include "ring/ring_rotate.h"

#include <atomic>

#include "ring/ring_heads.h"

namespace cplib::ring {

namespace {

std::atomic<int64_t> g_bytes_sent{0};

constexpr int kBlockTag = 0x50;  // + part index
constexpr int kGradTag = 0x60;

int64_t next_rank(const Config& c) { return (c.rank + 1) % c.size; }
int64_t prev_rank(const Config& c) { return (c.rank + c.size - 1) % c.size; }
int64_t source_rank(const Config& c, int64_t i) { return ((c.rank - i) % c.size + c.size) % c.size; }

void wait_all(std::vector<WorkPtr>& works) {
  for (auto& w : works) wait(w);
  works.clear();
}

// One step of the ring for one part: `send` goes to rank+1, `recv` is filled by rank-1.
void shift(const Config& c, const at::Tensor& send, const at::Tensor& recv, int tag,
           std::vector<WorkPtr>& works) {
  g_bytes_sent += static_cast<int64_t>(send.nbytes());
  at::Tensor out = recv.view(-1), in = send.view(-1);
  // Python groups (the threaded test group) have no send/recv: p2p shifts
  // with the split all-to-all there.
  if (c.rotate == Rotate::alltoall || python_group(c.pg)) {
    std::vector<int64_t> in_splits(c.size, 0), out_splits(c.size, 0);
    in_splits[next_rank(c)] = in.numel();
    out_splits[prev_rank(c)] = out.numel();
    works.push_back(all_to_all_split(c.pg, out, in, out_splits, in_splits));
    return;
  }
  // Receive first: on transports that match eagerly it saves a copy.
  works.push_back(cplib::recv(c.pg, out, static_cast<int>(prev_rank(c)), tag));
  works.push_back(cplib::send(c.pg, in, static_cast<int>(next_rank(c)), tag));
}

void shift_kv(const Config& c, const KV& send, const KV& recv, int tag,
              std::vector<WorkPtr>& works) {
  for (int p = 0; p < 2; ++p) shift(c, send[p], recv[p], tag + p, works);
}

KV empty_like_kv(const KV& x) { return {at::empty_like(x[0]), at::empty_like(x[1])}; }

}  // namespace

int64_t bytes_sent(bool reset) { return reset ? g_bytes_sent.exchange(0) : g_bytes_sent.load(); }

BlockRing::BlockRing(const Config& cfg, KV local) : cfg_(cfg) { buf_[0] = std::move(local); }

KV BlockRing::fetch(int64_t i) {
  wait_all(pending_);
  const int64_t n = cfg_.size;
  if (cfg_.rotate == Rotate::allgather) {
    if (i == 0) {
      for (int p = 0; p < 2 && n > 1; ++p) {
        at::Tensor in = buf_[0][p].view(-1);
        gathered_[p] = at::empty({n * in.numel()}, in.options());
        // Payload: our block reaches the N-1 other ranks (whatever the algorithm).
        g_bytes_sent += (n - 1) * static_cast<int64_t>(in.nbytes());
        pending_.push_back(all_gather_dim0(cfg_.pg, gathered_[p], in));
      }
      return buf_[0];
    }
    KV blk;
    for (int p = 0; p < 2; ++p) {
      const int64_t numel = buf_[0][p].numel();
      blk[p] = gathered_[p].narrow(0, source_rank(cfg_, i) * numel, numel).view(buf_[0][p].sizes());
    }
    return blk;
  }
  const KV cur = buf_[i % 2];
  if (i + 1 < n) {
    KV& nxt = buf_[(i + 1) % 2];
    const bool local_slot = (i + 1) % 2 == 0 && slot0_is_local_;
    if (!nxt[0].defined() || local_slot) nxt = empty_like_kv(cur);
    if (local_slot) slot0_is_local_ = false;
    shift_kv(cfg_, cur, nxt, kBlockTag, pending_);
  }
  return cur;
}

void BlockRing::finish() { wait_all(pending_); }

GradRing::GradRing(const Config& cfg, const at::Tensor& k, const at::Tensor& v,
                   at::ScalarType acc)
    : cfg_(cfg), sizes_{k.sizes().vec(), v.sizes().vec()} {
  const auto opts = k.options().dtype(acc).memory_format(at::MemoryFormat::Contiguous);
  if (cfg.rotate == Rotate::allgather && cfg.size > 1) {
    for (int p = 0; p < 2; ++p) all_[p] = at::zeros(cfg.size * c10::multiply_integers(sizes_[p]), opts);
    return;
  }
  buf_[0] = {at::empty(sizes_[0], opts), at::empty(sizes_[1], opts)};
  fresh_[0] = true;
  if (cfg.size > 1) buf_[1] = empty_like_kv(buf_[0]);
}

KV& GradRing::slot(int64_t i) {
  if (all_[0].defined()) {
    for (int p = 0; p < 2; ++p) {
      const int64_t numel = all_[p].numel() / cfg_.size;
      view_[p] = all_[p].narrow(0, source_rank(cfg_, i) * numel, numel).view(sizes_[p]);
    }
    return view_;
  }
  wait_all(pending_);
  return buf_[i % 2];
}

void GradRing::add(int64_t i, const at::Tensor& gk, const at::Tensor& gv, int64_t start,
                   int64_t len) {
  KV& acc = slot(i);
  bool& fresh = fresh_[i % 2];
  const bool overwrite = fresh && start == 0 && len == acc[0].size(2);
  if (fresh && !overwrite) {
    for (auto& t : acc) t.zero_();
  }
  fresh = false;
  for (int p = 0; p < 2; ++p)
    reduce_heads_into(acc[p].narrow(2, start, len), p == 0 ? gk : gv, cfg_.groups, !overwrite);
}

void GradRing::pass(int64_t i) {
  if (all_[0].defined() || cfg_.size == 1) return;
  KV& cur = slot(i);
  if (fresh_[i % 2]) {  // no step wrote it: nothing attended this block here
    for (auto& t : cur) t.zero_();
    fresh_[i % 2] = false;
  }
  shift_kv(cfg_, cur, buf_[(i + 1) % 2], kGradTag, pending_);
}

KV GradRing::result() {
  if (all_[0].defined()) {
    KV own;
    for (int p = 0; p < 2; ++p) {
      own[p] = at::empty(sizes_[p], all_[p].options());
      at::Tensor flat = own[p].view(-1);
      g_bytes_sent += static_cast<int64_t>(all_[p].nbytes() - flat.nbytes());
      wait(reduce_scatter_sum_dim0(cfg_.pg, flat, all_[p]));
    }
    return own;
  }
  wait_all(pending_);
  if (cfg_.size == 1) return buf_[0];
  // After N passes the accumulator of our own block sits where step N would read.
  return buf_[cfg_.size % 2];
}

}  // namespace cplib::ring
