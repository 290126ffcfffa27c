// Block and gradient exchange of the ring (see ring_rotate.h).
#include "ring/ring_rotate.h"

#include <atomic>

#include "ring/ring_heads.h"

namespace cplib::ring {

namespace {

std::atomic<int64_t> g_bytes_sent{0};

// `sizes` with the sequence dim (2) set to `len`.
std::vector<int64_t> with_len(std::vector<int64_t> sizes, int64_t len) {
  sizes[2] = len;
  return sizes;
}

// The first numel(sizes) elements of a flat buffer, viewed as `sizes`.
Tensor head_view(const Tensor& flat, const std::vector<int64_t>& sizes) {
  return aten::view(aten::narrow(flat, 0, 0, aten::numel_of(sizes)), sizes);
}

// The first numel(sizes) elements of `buf`, which is allocated on first use
// (flat, `longest` rows).
Tensor grow_view(Tensor& buf, const std::vector<int64_t>& sizes, int64_t longest,
                 const aten::Opts& opts) {
  if (!buf.defined()) buf = aten::empty({aten::numel_of(with_len(sizes, longest))}, opts);
  return head_view(buf, sizes);
}

// Block `rank`'s slot of a rank-major padded buffer, trimmed to its length.
Tensor padded_slot(const Tensor& all, int64_t size, int64_t rank,
                   const std::vector<int64_t>& padded_sizes, int64_t len) {
  const int64_t numel = all.numel() / size;
  return aten::narrow(aten::view(aten::narrow(all, 0, rank * numel, numel), padded_sizes), 2, 0,
                      len);
}

}  // namespace

void wait_all(std::vector<Tensor>& outs) {
  for (const Tensor& t : outs) wait(t);
  outs.clear();
}

Tensor exchange(const Config& c, const Tensor& send, int64_t dst, int64_t recv_numel, int64_t src,
                const aten::Opts& opts, std::vector<Tensor>& pending) {
  std::vector<int64_t> in_splits(static_cast<size_t>(c.size), 0), out_splits(in_splits);
  Tensor in;
  if (send.defined()) {
    in = aten::flat(send);
    in_splits[dst] = in.numel();
    g_bytes_sent += aten::nbytes(in);
  } else {
    in = aten::empty({0}, opts);
  }
  if (recv_numel > 0) out_splits[src] = recv_numel;
  Tensor out = all_to_all_split(c.group, in, out_splits, in_splits);
  pending.push_back(out);
  return recv_numel > 0 ? out : Tensor();
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
  KV& buf = buf_[s % 2];
  for (int p = 0; p < 2; ++p) {
    const int64_t numel = recv ? aten::numel_of(with_len(aten::sizes_of(local_[p]), len)) : 0;
    buf[p] = exchange(cfg_, send ? local_[p] : Tensor(), dst, numel, src, aten::opts_of(local_[p]),
                      recv_[s % 2]);
  }
}

KV BlockRing::fetch(int64_t s) {
  const int64_t n = cfg_.size;
  if (cfg_.rotate == Rotate::allgather) {
    if (s == 0 && n > 1) {
      const int64_t longest = cfg_.kv_layout.max_local_len();
      for (int p = 0; p < 2; ++p) {
        const auto padded = with_len(aten::sizes_of(local_[p]), longest);
        Tensor in = local_[p];
        if (in.size(2) != longest) {  // uneven shards travel padded to the longest
          in = aten::zeros(padded, aten::opts_of(local_[p]));
          aten::copy_(aten::narrow(in, 2, 0, local_[p].size(2)), local_[p]);
        }
        in = aten::flat(in);
        // Payload: our block reaches the N-1 other ranks (whatever the algorithm).
        g_bytes_sent += (n - 1) * aten::nbytes(in);
        gathered_[p] = all_gather_dim0(cfg_.group, in);
        recv_[0].push_back(gathered_[p]);
      }
    }
    if (s == 0) return local_;
    wait_all(recv_[0]);
    const int64_t src = plan_.source(s);
    KV blk;
    for (int p = 0; p < 2; ++p)
      blk[p] = padded_slot(gathered_[p], n, src,
                           with_len(aten::sizes_of(local_[p]), cfg_.kv_layout.max_local_len()),
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
  return {head_view(buf_[s % 2][0], with_len(aten::sizes_of(local_[0]), len)),
          head_view(buf_[s % 2][1], with_len(aten::sizes_of(local_[1]), len))};
}

void BlockRing::finish() {
  for (auto& r : recv_) wait_all(r);
  buf_ = {};
  gathered_ = {};
}

// --------------------------------------------------------------- gradients

GradRing::GradRing(const Config& cfg, const RingPlan& plan, const Tensor& k, const Tensor& v,
                   ScalarType acc)
    : cfg_(cfg),
      plan_(plan),
      sizes_{aten::sizes_of(k), aten::sizes_of(v)},
      opts_(aten::opts_of(k).dtype_(acc)) {
  const int64_t longest = cfg.kv_layout.max_local_len();
  if (cfg.rotate == Rotate::allgather && cfg.size > 1) {
    for (int p = 0; p < 2; ++p)
      all_[p] = aten::zeros({cfg.size * aten::numel_of(with_len(sizes_[p], longest))}, opts_);
    own_fresh_ = false;
    return;
  }
  own_ = {aten::empty(sizes_[0], opts_), aten::empty(sizes_[1], opts_)};
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
    wait_all(pending_);  // the previous step's gradient has left the buffer
    send_step_ = s;
    send_fresh_ = true;
  }
  for (int p = 0; p < 2; ++p)
    view_[p] = grow_view(send_[p], with_len(sizes_[p], len), longest, opts_);
  return view_;
}

void GradRing::add(int64_t s, const Tensor& gk, const Tensor& gv, int64_t start, int64_t len) {
  KV& acc = slot(s);
  bool& fresh = s == 0 ? own_fresh_ : send_fresh_;
  const bool overwrite = fresh && start == 0 && len == acc[0].size(2);
  if (fresh && !overwrite) {
    for (auto& t : acc) aten::zero_(t);
  }
  fresh = false;
  for (int p = 0; p < 2; ++p)
    reduce_heads_into(aten::narrow(acc[p], 2, start, len), p == 0 ? gk : gv, cfg_.groups,
                      !overwrite);
}

void GradRing::settle() {
  if (!recv_full_) return;
  wait_all(pending_);
  for (int p = 0; p < 2; ++p) {
    const Tensor got = head_view(recv_[p], sizes_[p]);
    if (own_fresh_)
      aten::copy_(own_[p], got);
    else
      aten::add_(own_[p], got);
  }
  own_fresh_ = false;
  recv_full_ = false;
  recv_ = {};  // not held through the next step's kernels
}

void GradRing::pass(int64_t s) {
  if (all_[0].defined() || s == 0) return;
  const bool send = plan_.receives(s), recv = plan_.sends(s);
  const int64_t owner = plan_.source(s), attender = plan_.target(s);
  if (send && (send_step_ != s || send_fresh_)) {  // attended, yet nothing added
    for (auto& t : slot(s)) aten::zero_(t);
    send_fresh_ = false;
  }
  if (recv) settle();  // the previous gradient is absorbed before the next arrives
  const int64_t len = plan_.kv_len(owner);
  for (int p = 0; p < 2; ++p) {
    const Tensor out = send ? head_view(send_[p], with_len(sizes_[p], len)) : Tensor();
    const int64_t numel = recv ? aten::numel_of(sizes_[p]) : 0;
    // One collective sends and receives: waiting for its output frees the
    // send buffer too.
    Tensor got = exchange(cfg_, out, owner, numel, attender, opts_, pending_);
    if (recv) recv_[p] = got;
  }
  recv_full_ = recv_full_ || recv;
}

KV GradRing::result() {
  if (all_[0].defined()) {
    KV own;
    const int64_t longest = cfg_.kv_layout.max_local_len();
    for (int p = 0; p < 2; ++p) {
      const auto padded_sizes = with_len(sizes_[p], longest);
      g_bytes_sent += aten::nbytes(all_[p]) -
                      aten::numel_of(padded_sizes) * static_cast<int64_t>(all_[p].element_size());
      const Tensor summed = reduce_scatter_sum_dim0(cfg_.group, all_[p]);
      wait(summed);
      const Tensor padded = aten::view(summed, padded_sizes);
      own[p] = sizes_[p][2] == longest ? padded
                                       : aten::contiguous(aten::narrow(padded, 2, 0, sizes_[p][2]));
    }
    return own;
  }
  settle();
  if (own_fresh_) {
    for (auto& t : own_) aten::zero_(t);
  }
  wait_all(pending_);
  send_ = recv_ = {};
  return own_;
}

}  // namespace cplib::ring
