// The Ulysses all-to-all. One copy packs the send buffer in the order the
// receivers want (per destination rank: its heads for seq -> heads, its rows
// for heads -> seq); the receive buffer is then the result as it stands, a
// strided view with no unpacking (GQA's gradient sums the repeated heads).
#include "ulysses/ulysses.h"

#include <algorithm>
#include <atomic>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "comm/handshake.h"

namespace cplib::ulysses {
namespace {

std::atomic<int64_t> g_bytes_sent{0};

struct Geometry {
  int64_t n = 1, B = 0, H = 0, S = 0, D = 0, R = 1;  // the input's sizes
};

// ValueError for anything that cannot be re-sharded; no communication.
Geometry check(const at::Tensor& x, int64_t n, bool to_heads, int64_t repeat,
               const std::vector<int64_t>& lengths, int64_t rank) {
  const char* op = to_heads ? "cplib.ulysses_reshard (seq -> heads)"
                            : "cplib.ulysses_reshard (heads -> seq)";
  TORCH_CHECK_VALUE(x.dim() == 4, op, ": expected a (B, H, S, D) tensor, got shape ", x.sizes());
  TORCH_CHECK_VALUE(x.device().is_cpu() || x.device().is_cuda(), op, ": unsupported device ",
                    x.device());
  TORCH_CHECK_VALUE(repeat >= 1, op, ": head_repeat=", repeat, " must be >= 1");
  TORCH_CHECK_VALUE(lengths.empty() || static_cast<int64_t>(lengths.size()) == n, op,
                    ": lengths has ", lengths.size(), " entries for ", n, " ranks");
  for (const int64_t l : lengths)
    TORCH_CHECK_VALUE(l > 0, op, ": lengths must be positive, got ", l);
  Geometry g{n, x.size(0), x.size(1), x.size(2), x.size(3), repeat};
  if (to_heads) {
    TORCH_CHECK_VALUE((g.H * repeat) % n == 0, op, ": ", g.H, " heads",
                      repeat > 1 ? " (repeated " + std::to_string(repeat) + "x)" : "",
                      " cannot be split over the Ulysses degree ", n);
    TORCH_CHECK_VALUE(repeat == 1 || g.H * repeat == n, op, ": head_repeat=", repeat,
                      " must bring the ", g.H, " heads to exactly the Ulysses degree ", n);
    TORCH_CHECK_VALUE(lengths.empty() || lengths[rank] == g.S, op, ": lengths[", rank, "] = ",
                      lengths.empty() ? 0 : lengths[rank], " but this rank holds ", g.S, " rows");
  } else {
    int64_t total = 0;
    for (const int64_t l : lengths) total += l;
    TORCH_CHECK_VALUE(!lengths.empty() || g.S % n == 0, op, ": sequence length ", g.S,
                      " cannot be split over the Ulysses degree ", n);
    TORCH_CHECK_VALUE(lengths.empty() || total == g.S, op, ": lengths sum to ", total,
                      " but the sequence has ", g.S, " rows");
    TORCH_CHECK_VALUE(repeat == 1 || (g.H == 1 && n % repeat == 0), op, ": head_repeat=", repeat,
                      " needs one head per rank (got ", g.H, ") and to divide the Ulysses degree ",
                      n);
  }
  return g;
}

// x viewed in send-buffer order, destination rank outermost.
at::Tensor send_view(const at::Tensor& x, const Geometry& g, bool to_heads) {
  const int64_t n = g.n;
  if (!to_heads)  // (N, Hn, B, S/N, D): rank j gets rows j of every head
    return x.view({g.B, g.H, n, g.S / n, g.D}).permute({2, 1, 0, 3, 4});
  if (g.R == 1)  // (N, S, B, Hn, D): rank j gets heads j of every row
    return x.view({g.B, n, g.H / n, g.S, g.D}).permute({1, 3, 0, 2, 4});
  // One repeated head per rank: rank j gets head j / R.
  return x.permute({1, 2, 0, 3}).unsqueeze(1).expand({g.H, g.R, g.S, g.B, g.D});
}

// One exchange in flight: its packed send buffer, its receive buffer and the
// unwaited all-to-all; finish() waits and returns the result.
struct Pending {
  Geometry g;
  bool to_heads = true;
  std::vector<int64_t> lengths;  // empty: S/N each
  int64_t rank = 0;
  at::Tensor send, recv;
  WorkPtr work;
};

// Packs x in the order the receivers want and starts the all-to-all. Ranks of
// different lengths (non-causal joint streams): seq -> heads sends equal
// parts and receives each rank's rows, heads -> seq the reverse; the orders
// are those of the even case, so the results have its strides.
Pending start(const PG& pg, const at::Tensor& x, const Geometry& g, bool to_heads,
              const std::vector<int64_t>& lengths) {
  Pending p{g, to_heads, lengths, pg->getRank(), {}, {}, {}};
  const int64_t n = g.n;
  std::vector<int64_t> in_splits(n), out_splits(n);
  if (lengths.empty() || to_heads) {
    const at::Tensor src = send_view(x, g, to_heads);
    if (n > 1 && src.is_contiguous()) {
      p.send = src.reshape({-1});  // already in send order: no copy
    } else {
      p.send = at::empty({src.numel()}, x.options());
      p.send.view(src.sizes()).copy_(src);
    }
    for (int64_t j = 0; j < n; ++j) in_splits[j] = out_splits[j] = p.send.numel() / n;
    if (!lengths.empty()) {
      const int64_t per_row = g.B * (g.H * g.R / n) * g.D;
      for (int64_t j = 0; j < n; ++j) out_splits[j] = lengths[j] * per_row;
    }
  } else {
    // Rows of rank j for every head: (H, B, L_j, D) per destination.
    p.send = at::empty({x.numel()}, x.options());
    int64_t offset = 0, row = 0;
    for (int64_t j = 0; j < n; ++j) {
      const at::Tensor rows = x.narrow(2, row, lengths[j]).permute({1, 0, 2, 3});
      p.send.narrow(0, offset, rows.numel()).view(rows.sizes()).copy_(rows);
      in_splits[j] = rows.numel();
      offset += rows.numel();
      row += lengths[j];
    }
    for (int64_t j = 0; j < n; ++j) out_splits[j] = g.H * g.B * lengths[p.rank] * g.D;
  }
  if (n == 1) {
    p.recv = p.send;  // a world of one keeps its (fresh) packed copy
    return p;
  }
  int64_t received = 0;
  for (const int64_t c : out_splits) received += c;
  p.recv = at::empty({received}, x.options());
  g_bytes_sent += (p.send.numel() - in_splits[p.rank]) * static_cast<int64_t>(p.send.element_size());
  p.work = all_to_all_split(pg, p.recv, p.send, out_splits, in_splits);
  return p;
}

at::Tensor finish(Pending& p) {
  wait(p.work);
  const Geometry& g = p.g;
  const int64_t n = g.n;
  if (p.to_heads) {  // (S_full, B, Hn, D) -> (B, Hn, S_full, D)
    int64_t total = g.S * n;
    if (!p.lengths.empty()) {
      total = 0;
      for (const int64_t l : p.lengths) total += l;
    }
    const int64_t hn = g.H * g.R / n;
    return p.recv.view({total, g.B, hn, g.D}).permute({1, 2, 0, 3});
  }
  // (H_out * R, B, S/N, D) -> (B, H_out, S/N, D)
  const int64_t s = p.lengths.empty() ? g.S / n : p.lengths[p.rank], h_out = g.H * n / g.R;
  if (g.R == 1) return p.recv.view({h_out, g.B, s, g.D}).permute({1, 0, 2, 3});
  at::Tensor summed = at::empty({h_out, g.B, s, g.D}, p.recv.options());
  at::sum_out(summed, p.recv.view({h_out, g.R, g.B, s, g.D}), {1});
  return summed.permute({1, 0, 2, 3});
}

// Validates every tensor, then one handshake for the call: every rank
// raises alike or none does.
std::vector<Geometry> checked(const PG& pg, std::string_view group_name, const char* op,
                              const std::vector<at::Tensor>& xs, bool to_heads,
                              const std::vector<int64_t>& head_repeats,
                              const std::vector<int64_t>& lengths) {
  Handshake hs(op);
  std::vector<Geometry> gs;
  hs.validate([&] {
    CallSignature& sig = hs.sig();
    for (size_t i = 0; i < xs.size(); ++i) {
      gs.push_back(check(xs[i], pg->getSize(), to_heads, head_repeats[i], lengths,
                         pg->getRank()));
      // With lengths the ranks' rows differ by design: compare the lengths instead.
      const char* name = xs.size() == 1 ? "x" : i == 0 ? "q" : i == 1 ? "k" : "v";
      sig.add_meta(name, xs[i], lengths.empty() ? -1 : 2);
      sig.add("head_repeat[" + std::to_string(i) + "]", head_repeats[i]);
    }
    for (size_t r = 0; r < lengths.size(); ++r)
      sig.add("lengths[" + std::to_string(r) + "]", lengths[r]);
    sig.add_flag("to_heads", to_heads);
  });
  hs.exchange(group_name, pg, xs.front().device());
  return gs;
}

}  // namespace

int64_t bytes_sent(bool reset) { return reset ? g_bytes_sent.exchange(0) : g_bytes_sent.load(); }

at::Tensor reshard(const at::Tensor& x, std::string_view group_name, bool to_heads,
                   int64_t head_repeat, const std::vector<int64_t>& lengths) {
  PG pg = resolve_group(group_name);
  const Geometry g =
      checked(pg, group_name, "ulysses_reshard", {x}, to_heads, {head_repeat}, lengths).front();
  Pending p = start(pg, x, g, to_heads, lengths);
  return finish(p);
}

std::vector<at::Tensor> reshard_many(const std::vector<at::Tensor>& xs,
                                     std::string_view group_name, bool to_heads,
                                     const std::vector<int64_t>& head_repeats,
                                     const std::vector<int64_t>& lengths) {
  PG pg = resolve_group(group_name);
  TORCH_CHECK_VALUE(head_repeats.size() == xs.size(), "cplib.ulysses_reshard_qkv: ",
                    head_repeats.size(), " head repeats for ", xs.size(), " tensors");
  const std::vector<Geometry> gs =
      checked(pg, group_name, "ulysses_reshard_qkv", xs, to_heads, head_repeats, lengths);
  // All exchanges in flight at once: packing the next overlaps the previous.
  std::vector<Pending> pending;
  for (size_t i = 0; i < xs.size(); ++i) pending.push_back(start(pg, xs[i], gs[i], to_heads, lengths));
  std::vector<at::Tensor> out;
  for (Pending& p : pending) out.push_back(finish(p));
  return out;
}

}  // namespace cplib::ulysses
