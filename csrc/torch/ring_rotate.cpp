// Ring rotation: "p2p" posts a send/recv pair per step, "alltoall" one
// all-to-all whose only non-empty splits are the two neighbours, "allgather"
// gathers every block up front (and reduce-scatters gradients at the end).
#include "ring_rotate.h"

#include <atomic>

namespace cplib::ring {

namespace {

std::atomic<int64_t> g_bytes_sent{0};

constexpr int kBlockTag = 0x52;
constexpr int kGradTag = 0x53;

int64_t next_rank(const Config& c) { return (c.rank + 1) % c.size; }
int64_t prev_rank(const Config& c) { return (c.rank + c.size - 1) % c.size; }

void wait_all(std::vector<WorkPtr>& works) {
  for (auto& w : works) wait(w);
  works.clear();
}

// One step of the ring: `send` goes to rank+1, `recv` is filled by rank-1.
void shift(const Config& c, at::Tensor& send, at::Tensor& recv, int tag,
           std::vector<WorkPtr>& works) {
  g_bytes_sent += static_cast<int64_t>(send.nbytes());
  // Python groups (the threaded test group) have no send/recv: p2p shifts
  // with the split all-to-all there.
  if (c.rotate == Rotate::alltoall || python_group(c.pg)) {
    std::vector<int64_t> in_splits(c.size, 0), out_splits(c.size, 0);
    in_splits[next_rank(c)] = send.numel();
    out_splits[prev_rank(c)] = recv.numel();
    works.push_back(all_to_all_split(c.pg, recv, send, out_splits, in_splits));
    return;
  }
  // Receive first: on transports that match eagerly it saves a copy.
  works.push_back(cplib::recv(c.pg, recv, static_cast<int>(prev_rank(c)), tag));
  works.push_back(cplib::send(c.pg, send, static_cast<int>(next_rank(c)), tag));
}

int64_t source_rank(const Config& c, int64_t i) { return ((c.rank - i) % c.size + c.size) % c.size; }

}  // namespace

int64_t bytes_sent(bool reset) { return reset ? g_bytes_sent.exchange(0) : g_bytes_sent.load(); }

BlockRing::BlockRing(const Config& cfg, at::Tensor local) : cfg_(cfg) {
  buf_[0] = std::move(local);
}

at::Tensor BlockRing::fetch(int64_t i) {
  wait_all(pending_);
  const int64_t n = cfg_.size;
  if (cfg_.rotate == Rotate::allgather) {
    if (i == 0) {
      if (n > 1) {
        gathered_ = at::empty({n * buf_[0].numel()}, buf_[0].options());
        // Payload: our block reaches the N-1 other ranks (whatever the algorithm).
        g_bytes_sent += (n - 1) * static_cast<int64_t>(buf_[0].nbytes());
        pending_.push_back(all_gather_dim0(cfg_.pg, gathered_, buf_[0]));
      }
      return buf_[0];
    }
    const int64_t numel = buf_[0].numel();
    return gathered_.narrow(0, source_rank(cfg_, i) * numel, numel);
  }
  at::Tensor& cur = buf_[i % 2];
  if (i + 1 < n) {
    at::Tensor& nxt = buf_[(i + 1) % 2];
    if (!nxt.defined()) nxt = at::empty_like(cur);
    shift(cfg_, cur, nxt, kBlockTag, pending_);
  }
  return cur;
}

void BlockRing::finish() { wait_all(pending_); }

GradRing::GradRing(const Config& cfg, int64_t numel, const at::TensorOptions& opts)
    : cfg_(cfg), numel_(numel) {
  if (cfg.rotate == Rotate::allgather && cfg.size > 1) {
    all_ = at::zeros({cfg.size * numel}, opts);
  } else {
    buf_[0] = at::zeros({numel}, opts);
    if (cfg.size > 1) buf_[1] = at::empty({numel}, opts);
  }
}

at::Tensor GradRing::at(int64_t i) {
  if (all_.defined()) return all_.narrow(0, source_rank(cfg_, i) * numel_, numel_);
  wait_all(pending_);
  return buf_[i % 2];
}

void GradRing::pass(int64_t i) {
  if (all_.defined() || cfg_.size == 1) return;
  shift(cfg_, buf_[i % 2], buf_[(i + 1) % 2], kGradTag, pending_);
}

at::Tensor GradRing::result() {
  if (all_.defined()) {
    at::Tensor own = at::empty({numel_}, all_.options());
    g_bytes_sent += static_cast<int64_t>(all_.nbytes() - own.nbytes());
    WorkPtr w = reduce_scatter_sum_dim0(cfg_.pg, own, all_);
    wait(w);
    return own;
  }
  wait_all(pending_);
  if (cfg_.size == 1) return buf_[0];
  // After N passes the accumulator of our own block sits where step N would read.
  return buf_[cfg_.size % 2];
}

}  // namespace cplib::ring
