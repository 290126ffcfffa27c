// Block and gradient exchange of the ring (see ring_rotate.h).
#include "ring/ring_rotate.h"

#include <atomic>

#include "attention/heads.h"

namespace cplib::ring {

namespace {

std::atomic<int64_t> g_bytes_sent{0};

// The first `numel` elements of a flat buffer.
Tensor head(const Tensor& flat, int64_t numel) { return aten::carve(flat, {numel}, 0); }

}  // namespace

// ----------------------------------------------------------------- packing

Packing::Packing(const Tensor& k, const Tensor& v)
    : sizes_{aten::sizes_of(k), aten::sizes_of(v)},
      row_numel_{k.size(0) * k.size(1) * k.size(3), v.size(0) * v.size(1) * v.size(3)} {}

std::vector<int64_t> Packing::sizes(int p, int64_t len) const {
  std::vector<int64_t> s = sizes_[p];
  s[2] = len;
  return s;
}

KV Packing::views(const Tensor& buf, int64_t len, int64_t offset) const {
  return {aten::carve(buf, sizes(0, len), offset),
          aten::carve(buf, sizes(1, len), offset + numel(0, len))};
}

KV Packing::views_padded(const Tensor& buf, int64_t len, int64_t longest, int64_t offset) const {
  const KV full = views(buf, longest, offset);
  return {aten::rows(full[0], 2, 0, len), aten::rows(full[1], 2, 0, len)};
}

// --------------------------------------------------------------- exchange

void wait_all(std::vector<Tensor>& outs) {
  for (const Tensor& t : outs) wait(t);
  outs.clear();
}

Tensor exchange(const Config& c, const Tensor& send, int64_t dst, int64_t recv_numel, int64_t src,
                const aten::Opts& opts, std::vector<Tensor>& pending) {
  std::vector<int64_t> in_splits(static_cast<size_t>(c.size), 0), out_splits(in_splits);
  Tensor in;
  if (send.defined()) {
    in = send.dim() == 1 ? send : aten::flat(send);
    in_splits[dst] = in.numel();
    g_bytes_sent += aten::nbytes(in);
  } else {
    in = aten::empty({0}, opts);
  }
  if (recv_numel > 0) out_splits[src] = recv_numel;
  Tensor out = c.rotate == Rotate::p2p ? send_recv(c.group, in, dst, recv_numel, src)
                                       : all_to_all_split(c.group, in, out_splits, in_splits);
  pending.push_back(out);
  return recv_numel > 0 ? out : Tensor();
}

int64_t bytes_sent(bool reset) { return reset ? g_bytes_sent.exchange(0) : g_bytes_sent.load(); }
void count_bytes_sent(int64_t bytes) { g_bytes_sent += bytes; }

// ------------------------------------------------------------------ blocks

BlockRing::BlockRing(const Config& cfg, const RingPlan& plan, const Tensor& k, const Tensor& v)
    : cfg_(cfg),
      plan_(plan),
      // Step 0 attends them as they are: kernels want dense rows.
      local_{k.is_contiguous() ? k : aten::contiguous(k),
             v.is_contiguous() ? v : aten::contiguous(v)},
      pack_(k, v) {}

const Tensor& BlockRing::packed(int64_t longest) {
  if (packed_.defined()) return packed_;
  packed_ = aten::empty({pack_.total(longest)}, aten::opts_of(local_[0]));
  const KV dst = pack_.views_padded(packed_, local_[0].size(2), longest, 0);
  for (int p = 0; p < 2; ++p) aten::copy_(dst[p], local_[p]);
  return packed_;
}

Tensor BlockRing::packed_rows(const std::vector<Range>& ranges, int64_t count) const {
  Tensor buf = aten::empty({pack_.total(count)}, aten::opts_of(local_[0]));
  const KV dst = pack_.views(buf, count);
  int64_t at = 0;
  for (const Range& g : ranges) {
    for (int p = 0; p < 2; ++p)
      aten::copy_(aten::rows(dst[p], 2, at, g.len), aten::rows(local_[p], 2, g.start, g.len));
    at += g.len;
  }
  return buf;
}

void BlockRing::post(int64_t s) {
  if (s >= plan_.steps()) return;
  const bool recv = plan_.receives(s), send = plan_.sends(s);
  Tensor out;
  if (send)
    out = plan_.send_rows(s).empty() ? packed(local_[0].size(2))
                                     : packed_rows(plan_.send_rows(s), plan_.send_len(s));
  buf_[s % 2] = exchange(cfg_, out, plan_.target(s), recv ? pack_.total(plan_.recv_len(s)) : 0,
                         plan_.source(s), aten::opts_of(local_[0]), recv_[s % 2]);
}

KV BlockRing::fetch(int64_t s) {
  const int64_t n = cfg_.size;
  if (cfg_.rotate == Rotate::allgather) {
    const int64_t longest = cfg_.kv_layout.max_local_len();
    if (s == 0 && n > 1) {
      // Uneven shards travel padded to the longest (the padding is never read).
      const Tensor& in = packed(longest);
      // Payload: our block reaches the N-1 other ranks (whatever the algorithm).
      g_bytes_sent += (n - 1) * aten::nbytes(in);
      gathered_ = all_gather_dim0(cfg_.group, in);
      recv_[0].push_back(gathered_);
    }
    if (s == 0) return local_;
    wait_all(recv_[0]);
    const int64_t src = plan_.source(s);
    return pack_.views_padded(gathered_, plan_.kv_len(src), longest, src * pack_.total(longest));
  }
  if (s == 0) {
    post(1);
    return local_;
  }
  wait_all(recv_[s % 2]);
  post(s + 1);
  if (s + 1 == plan_.steps()) buf_[(s + 1) % 2] = Tensor();  // step s-1's block: done with
  if (!plan_.receives(s)) return {};
  return pack_.views(buf_[s % 2], plan_.recv_len(s));
}

Tensor BlockRing::arrived(int64_t s) const {
  if (s == 0 || cfg_.rotate == Rotate::allgather || !plan_.receives(s)) return Tensor();
  return buf_[s % 2];
}

void BlockRing::finish() {
  for (auto& r : recv_) wait_all(r);
  buf_ = {};
  gathered_ = Tensor();
  packed_ = Tensor();
}

// --------------------------------------------------------------- gradients

ScalarType grad_wire_dtype(const Config& cfg, ScalarType input, ScalarType acc) {
  const bool half = input == ScalarType::BFloat16 || input == ScalarType::Half;
  const Mask& m = cfg.mask;
  const bool causal_at_most = m.bounds.size() <= 2 && m.left >= m.seq_len - 1 &&
                              (m.causal || m.right >= m.seq_len - 1);
  const bool derived = (cfg.layout == SeqLayout::sequential ||
                        cfg.layout == SeqLayout::head_tail) &&
                       !cfg.q_layout.is_explicit() && !cfg.kv_layout.is_explicit();
  return half && causal_at_most && derived ? input : acc;
}

GradRing::GradRing(const Config& cfg, const RingPlan& plan, const Tensor& k, const Tensor& v,
                   ScalarType acc)
    : cfg_(cfg),
      plan_(plan),
      pack_(k, v),
      own_len_(k.size(2)),
      opts_(aten::opts_of(k).dtype_(acc)),
      wire_(aten::opts_of(k).dtype_(
          cfg.rotate == Rotate::allgather ? acc : grad_wire_dtype(cfg, k.scalar_type(), acc))) {
  const int64_t longest = cfg.kv_layout.max_local_len();
  if (cfg.rotate == Rotate::allgather && cfg.size > 1) {
    all_ = aten::zeros({cfg.size * pack_.total(longest)}, opts_);
    own_fresh_ = false;
    return;
  }
  own_ = {aten::empty(pack_.sizes(0, own_len_), opts_),
          aten::empty(pack_.sizes(1, own_len_), opts_)};
}

KV& GradRing::slot(int64_t s) {
  const int64_t src = plan_.source(s), len = plan_.recv_len(s);
  const int64_t longest = cfg_.kv_layout.max_local_len();
  if (all_.defined()) {
    view_ = pack_.views_padded(all_, plan_.kv_len(src), longest, src * pack_.total(longest));
    return view_;
  }
  if (s == 0) return own_;
  if (send_step_ != s) {
    wait_all(pending_);  // the previous step's gradient has left the buffer
    send_step_ = s;
    send_fresh_ = true;
    if (spent_step_ == s) {
      sending_ = spent_;
    } else {
      if (!send_.defined()) send_ = aten::empty({pack_.total(longest)}, wire_);
      sending_ = send_;
    }
    spent_ = Tensor();
    view_ = pack_.views(sending_, len);
  }
  return view_;
}

void GradRing::reuse(int64_t s, const Tensor& spent) {
  if (all_.defined() || s == 0 || !spent.defined() || spent.scalar_type() != wire_.dtype ||
      spent.numel() != pack_.total(plan_.recv_len(s)))
    return;
  spent_ = spent;
  spent_step_ = s;
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
    attention::reduce_heads_into(aten::rows(acc[p], 2, start, len), p == 0 ? gk : gv, cfg_.groups,
                                 !overwrite);
}

void GradRing::settle() {
  if (!recv_full_) return;
  wait_all(pending_);
  const std::vector<Range>& rows = plan_.send_rows(recv_step_);
  const KV got = pack_.views(recv_, plan_.send_len(recv_step_));
  if (rows.empty()) {  // the whole block travelled
    for (int p = 0; p < 2; ++p) {
      if (own_fresh_)
        aten::copy_(own_[p], got[p]);
      else
        aten::add_(own_[p], got[p]);
    }
  } else {  // the gradient of the rows we sent, into those rows
    if (own_fresh_) {
      for (auto& t : own_) aten::zero_(t);
    }
    int64_t at = 0;
    for (const Range& g : rows) {
      for (int p = 0; p < 2; ++p)
        aten::add_(aten::rows(own_[p], 2, g.start, g.len), aten::rows(got[p], 2, at, g.len));
      at += g.len;
    }
  }
  own_fresh_ = false;
  recv_full_ = false;
  recv_ = Tensor();  // not held through the next step's kernels
}

void GradRing::pass(int64_t s) {
  if (all_.defined() || s == 0) return;
  const bool send = plan_.receives(s), recv = plan_.sends(s);
  const int64_t owner = plan_.source(s), attender = plan_.target(s);
  if (send && (send_step_ != s || send_fresh_)) {  // attended, yet nothing added
    for (auto& t : slot(s)) aten::zero_(t);
    send_fresh_ = false;
  }
  if (recv) settle();  // the previous gradient is absorbed before the next arrives
  const Tensor out = send ? head(sending_, pack_.total(plan_.recv_len(s))) : Tensor();
  // One collective sends and receives: waiting for its output frees the
  // send buffer too.
  Tensor got = exchange(cfg_, out, owner, recv ? pack_.total(plan_.send_len(s)) : 0, attender,
                        wire_, pending_);
  if (recv) {
    recv_ = got;
    recv_step_ = s;
  }
  recv_full_ = recv_full_ || recv;
  // The exchange holds the buffer until it completes: a spent block is not
  // kept through the next step's kernels.
  sending_ = Tensor();
  view_ = {};
}

KV GradRing::result() {
  if (all_.defined()) {
    const int64_t longest = cfg_.kv_layout.max_local_len();
    const int64_t padded = pack_.total(longest);
    g_bytes_sent += aten::nbytes(all_) - padded * static_cast<int64_t>(all_.element_size());
    const Tensor summed = reduce_scatter_sum_dim0(cfg_.group, all_);
    wait(summed);
    // Fresh tensors of their own: outputs of the op never share memory.
    const KV got = pack_.views_padded(summed, own_len_, longest, 0);
    KV own;
    for (int p = 0; p < 2; ++p) {
      own[p] = aten::empty(pack_.sizes(p, own_len_), opts_);
      aten::copy_(own[p], got[p]);
    }
    return own;
  }
  settle();
  if (own_fresh_) {
    for (auto& t : own_) aten::zero_(t);
  }
  wait_all(pending_);
  send_ = sending_ = spent_ = recv_ = Tensor();
  return own_;
}

}  // namespace cplib::ring
