// Block and gradient exchange of the ring (see ring_rotate.h).
#include "ring/ring_rotate.h"

#include <atomic>

#include "ring/ring_heads.h"

namespace cplib::ring {

namespace {

std::atomic<int64_t> g_bytes_sent{0};

constexpr int kBlockTag = 0x50;  // + part index
constexpr int kGradTag = 0x60;


// `sizes` with the sequence dim (2) set to `len`.
std::vector<int64_t> with_len(std::vector<int64_t> sizes, int64_t len) {
  sizes[2] = len;
  return sizes;
}

// The first numel(sizes) elements of a flat buffer, viewed as `sizes`.
at::Tensor head_view(const at::Tensor& flat, const std::vector<int64_t>& sizes) {
  return flat.narrow(0, 0, c10::multiply_integers(sizes)).view(sizes);
}

// The first numel(sizes) elements of `buf`, which is allocated on first use
// (flat, `longest` rows).
at::Tensor grow_view(at::Tensor& buf, const std::vector<int64_t>& sizes, int64_t longest,
                     const at::TensorOptions& opts) {
  if (!buf.defined()) buf = at::empty({c10::multiply_integers(with_len(sizes, longest))}, opts);
  return head_view(buf, sizes);
}

// Block `rank`'s slot of a rank-major padded buffer, trimmed to its length.
at::Tensor padded_slot(const at::Tensor& all, int64_t size, int64_t rank,
                       const std::vector<int64_t>& padded_sizes, int64_t len) {
  const int64_t numel = all.numel() / size;
  return all.narrow(0, rank * numel, numel).view(padded_sizes).narrow(2, 0, len);
}

}  // namespace

void wait_all(std::vector<WorkPtr>& works) {
  for (auto& w : works) wait(w);
  works.clear();
}

void exchange(const Config& c, const at::Tensor& send, int64_t dst, const at::Tensor& recv,
              int64_t src, int tag, const at::TensorOptions& opts, std::vector<WorkPtr>& recvs,
              std::vector<WorkPtr>& sends) {
  if (send.defined()) g_bytes_sent += static_cast<int64_t>(send.nbytes());
  if (c.rotate == Rotate::alltoall || python_group(c.pg)) {
    at::Tensor in = send.defined() ? send.view(-1) : at::empty({0}, opts);
    at::Tensor out = recv.defined() ? recv.view(-1) : at::empty({0}, opts);
    std::vector<int64_t> in_splits(c.size, 0), out_splits(c.size, 0);
    in_splits[dst] = in.numel();
    out_splits[src] = out.numel();
    WorkPtr w = all_to_all_split(c.pg, out, in, out_splits, in_splits);
    recvs.push_back(w);
    if (&sends != &recvs) sends.push_back(w);  // it reads the send buffer too
    return;
  }
  // Receive first: on transports that match eagerly it saves a copy.
  if (recv.defined()) {
    at::Tensor out = recv.view(-1);
    recvs.push_back(cplib::recv(c.pg, out, static_cast<int>(src), tag));
  }
  if (send.defined()) {
    at::Tensor in = send.view(-1);
    sends.push_back(cplib::send(c.pg, in, static_cast<int>(dst), tag));
  }
}

int64_t bytes_sent(bool reset) { return reset ? g_bytes_sent.exchange(0) : g_bytes_sent.load(); }
void count_bytes_sent(int64_t bytes) { g_bytes_sent += bytes; }

// ------------------------------------------------------------------ blocks

BlockRing::BlockRing(const Config& cfg, const RingPlan& plan, KV local)
    : cfg_(cfg), plan_(plan), local_(std::move(local)) {}

void BlockRing::post(int64_t s) {
  if (s >= plan_.steps()) return;
  const bool recv = plan_.receives(s), send = plan_.sends(s);
  const int64_t src = plan_.source(s), dst = plan_.target(s);
  const int64_t len = plan_.kv_len(src);
  const bool collective = cfg_.rotate == Rotate::alltoall || python_group(cfg_.pg);
  if (!recv && !send && !collective) return;
  KV& buf = buf_[s % 2];
  for (int p = 0; p < 2; ++p) {
    at::Tensor into;
    if (recv)
      into = grow_view(buf[p], with_len(local_[p].sizes().vec(), len),
                       cfg_.kv_layout.max_local_len(), local_[p].options());
    exchange(cfg_, send ? local_[p] : at::Tensor(), dst, into, src, kBlockTag + p,
             local_[p].options(), recv_[s % 2], sends_);
  }
}

KV BlockRing::fetch(int64_t s) {
  const int64_t n = cfg_.size;
  if (cfg_.rotate == Rotate::allgather) {
    if (s == 0 && n > 1) {
      const int64_t longest = cfg_.kv_layout.max_local_len();
      for (int p = 0; p < 2; ++p) {
        const auto padded = with_len(local_[p].sizes().vec(), longest);
        at::Tensor in = local_[p];
        if (in.size(2) != longest) {  // uneven shards travel padded to the longest
          in = at::zeros(padded, local_[p].options());
          in.narrow(2, 0, local_[p].size(2)).copy_(local_[p]);
        }
        in = in.view(-1);
        gathered_[p] = at::empty({n * in.numel()}, in.options());
        // Payload: our block reaches the N-1 other ranks (whatever the algorithm).
        g_bytes_sent += (n - 1) * static_cast<int64_t>(in.nbytes());
        recv_[0].push_back(all_gather_dim0(cfg_.pg, gathered_[p], in));
      }
    }
    if (s == 0) return local_;
    wait_all(recv_[0]);
    const int64_t src = plan_.source(s);
    KV blk;
    for (int p = 0; p < 2; ++p)
      blk[p] = padded_slot(gathered_[p], n, src,
                           with_len(local_[p].sizes().vec(), cfg_.kv_layout.max_local_len()),
                           plan_.kv_len(src));
    return blk;
  }
  if (s == 0) {
    post(1);
    return local_;
  }
  wait_all(recv_[s % 2]);
  post(s + 1);
  if (s + 1 == plan_.steps()) buf_[(s + 1) % 2] = {};  // step s-1's block: done with
  if (!plan_.receives(s)) return {};
  const int64_t len = plan_.kv_len(plan_.source(s));
  return {head_view(buf_[s % 2][0], with_len(local_[0].sizes().vec(), len)),
          head_view(buf_[s % 2][1], with_len(local_[1].sizes().vec(), len))};
}

void BlockRing::finish() {
  for (auto& r : recv_) wait_all(r);
  wait_all(sends_);
  buf_ = {};
}

// --------------------------------------------------------------- gradients

GradRing::GradRing(const Config& cfg, const RingPlan& plan, const at::Tensor& k,
                   const at::Tensor& v, at::ScalarType acc)
    : cfg_(cfg),
      plan_(plan),
      sizes_{k.sizes().vec(), v.sizes().vec()},
      opts_(k.options().dtype(acc).memory_format(at::MemoryFormat::Contiguous)) {
  const int64_t longest = cfg.kv_layout.max_local_len();
  if (cfg.rotate == Rotate::allgather && cfg.size > 1) {
    for (int p = 0; p < 2; ++p)
      all_[p] = at::zeros(cfg.size * c10::multiply_integers(with_len(sizes_[p], longest)), opts_);
    own_fresh_ = false;
    return;
  }
  own_ = {at::empty(sizes_[0], opts_), at::empty(sizes_[1], opts_)};
}

KV& GradRing::slot(int64_t s) {
  const int64_t src = plan_.source(s), len = plan_.kv_len(src);
  const int64_t longest = cfg_.kv_layout.max_local_len();
  if (all_[0].defined()) {
    for (int p = 0; p < 2; ++p)
      view_[p] = padded_slot(all_[p], cfg_.size, src, with_len(sizes_[p], longest), len);
    return view_;
  }
  if (s == 0) return own_;
  if (send_step_ != s) {
    wait_all(sending_);  // the previous step's gradient has left the buffer
    send_step_ = s;
    send_fresh_ = true;
  }
  for (int p = 0; p < 2; ++p)
    view_[p] = grow_view(send_[p], with_len(sizes_[p], len), longest, opts_);
  return view_;
}

void GradRing::add(int64_t s, const at::Tensor& gk, const at::Tensor& gv, int64_t start,
                   int64_t len) {
  KV& acc = slot(s);
  bool& fresh = s == 0 ? own_fresh_ : send_fresh_;
  const bool overwrite = fresh && start == 0 && len == acc[0].size(2);
  if (fresh && !overwrite) {
    for (auto& t : acc) t.zero_();
  }
  fresh = false;
  for (int p = 0; p < 2; ++p)
    reduce_heads_into(acc[p].narrow(2, start, len), p == 0 ? gk : gv, cfg_.groups, !overwrite);
}

void GradRing::settle() {
  if (!recv_full_) return;
  wait_all(receiving_);
  for (int p = 0; p < 2; ++p) {
    if (own_fresh_) own_[p].zero_();
    own_[p].add_(head_view(recv_[p], sizes_[p]));
  }
  own_fresh_ = false;
  recv_full_ = false;
  recv_ = {};  // not held through the next step's kernels
}

void GradRing::pass(int64_t s) {
  if (all_[0].defined() || s == 0) return;
  const bool send = plan_.receives(s), recv = plan_.sends(s);
  const int64_t owner = plan_.source(s), attender = plan_.target(s);
  const bool collective = cfg_.rotate == Rotate::alltoall || python_group(cfg_.pg);
  if (send && (send_step_ != s || send_fresh_)) {  // attended, yet nothing added
    for (auto& t : slot(s)) t.zero_();
    send_fresh_ = false;
  }
  if (recv) settle();  // the receive buffer is free for this step's
  if (send || recv || collective) {
    const int64_t len = plan_.kv_len(owner), longest = cfg_.kv_layout.max_local_len();
    for (int p = 0; p < 2; ++p) {
      at::Tensor out = send ? head_view(send_[p], with_len(sizes_[p], len)) : at::Tensor();
      at::Tensor in = recv ? grow_view(recv_[p], sizes_[p], longest, opts_) : at::Tensor();
      exchange(cfg_, out, owner, in, attender, kGradTag + p, opts_, receiving_, sending_);
    }
  }
  recv_full_ = recv_full_ || recv;
}

KV GradRing::result() {
  if (all_[0].defined()) {
    KV own;
    const int64_t longest = cfg_.kv_layout.max_local_len();
    for (int p = 0; p < 2; ++p) {
      at::Tensor padded = at::empty(with_len(sizes_[p], longest), all_[p].options());
      at::Tensor flat = padded.view(-1);
      g_bytes_sent += static_cast<int64_t>(all_[p].nbytes() - flat.nbytes());
      wait(reduce_scatter_sum_dim0(cfg_.pg, flat, all_[p]));
      own[p] = sizes_[p][2] == longest ? padded : padded.narrow(2, 0, sizes_[p][2]).contiguous();
    }
    return own;
  }
  settle();
  if (own_fresh_) {
    for (auto& t : own_) t.zero_();
  }
  wait_all(sending_);
  wait_all(receiving_);
  send_ = recv_ = {};
  return own_;
}

}  // namespace cplib::ring
