// The Ulysses all-to-all. One copy packs the send buffer in the order the
// receivers want (per destination rank: its heads for seq -> heads, its rows
// for heads -> seq); the exchange's output is then the result as it stands,
// a strided view with no unpacking (GQA's gradient sums the repeated heads).
#include "ulysses/ulysses.h"

#include <atomic>
#include <string>
#include <vector>

#include "comm/collectives.h"
#include "comm/handshake.h"
#include "common/aten.h"
#include "common/format.h"

namespace cplib::ulysses {
namespace {

namespace ops = torch::stable;
using Sizes = torch::headeronly::IntHeaderOnlyArrayRef;

std::atomic<int64_t> g_bytes_sent{0};

struct Geometry {
  int64_t n = 1, B = 0, H = 0, S = 0, D = 0, R = 1;  // the input's sizes
};

// ValueError for anything that cannot be re-sharded; no communication.
Geometry check(const Tensor& x, int64_t n, bool to_heads, int64_t repeat,
               const std::vector<int64_t>& lengths, int64_t rank) {
  const char* op = to_heads ? "cplib.ulysses_reshard (seq -> heads)"
                            : "cplib.ulysses_reshard (heads -> seq)";
  CPLIB_CHECK_VALUE(x.dim() == 4, op, ": expected a (B, H, S, D) tensor, got shape ", x.sizes());
  CPLIB_CHECK_VALUE(x.is_cpu() || x.is_cuda(), op, ": unsupported device ", x.device());
  CPLIB_CHECK_VALUE(repeat >= 1, op, ": head_repeat=", repeat, " must be >= 1");
  CPLIB_CHECK_VALUE(lengths.empty() || static_cast<int64_t>(lengths.size()) == n, op,
                    ": lengths has ", lengths.size(), " entries for ", n, " ranks");
  for (const int64_t l : lengths)
    CPLIB_CHECK_VALUE(l > 0, op, ": lengths must be positive, got ", l);
  Geometry g{n, x.size(0), x.size(1), x.size(2), x.size(3), repeat};
  if (to_heads) {
    CPLIB_CHECK_VALUE((g.H * repeat) % n == 0, op, ": ", g.H, " heads",
                      repeat > 1 ? " (repeated " + std::to_string(repeat) + "x)" : "",
                      " cannot be split over the Ulysses degree ", n);
    CPLIB_CHECK_VALUE(repeat == 1 || g.H * repeat == n, op, ": head_repeat=", repeat,
                      " must bring the ", g.H, " heads to exactly the Ulysses degree ", n);
    CPLIB_CHECK_VALUE(lengths.empty() || lengths[rank] == g.S, op, ": lengths[", rank,
                      "] = ", lengths.empty() ? 0 : lengths[rank], " but this rank holds ", g.S,
                      " rows");
  } else {
    int64_t total = 0;
    for (const int64_t l : lengths) total += l;
    CPLIB_CHECK_VALUE(!lengths.empty() || g.S % n == 0, op, ": sequence length ", g.S,
                      " cannot be split over the Ulysses degree ", n);
    CPLIB_CHECK_VALUE(lengths.empty() || total == g.S, op, ": lengths sum to ", total,
                      " but the sequence has ", g.S, " rows");
    CPLIB_CHECK_VALUE(repeat == 1 || (g.H == 1 && n % repeat == 0), op, ": head_repeat=", repeat,
                      " needs one head per rank (got ", g.H, ") and to divide the Ulysses degree ",
                      n);
  }
  return g;
}

// x viewed in send-buffer order, destination rank outermost.
Tensor send_view(const Tensor& x, const Geometry& g, bool to_heads) {
  const int64_t n = g.n;
  if (!to_heads)  // (N, Hn, B, S/N, D): rank j gets rows j of every head
    return aten::permute(ops::view(x, {g.B, g.H, n, g.S / n, g.D}), {2, 1, 0, 3, 4});
  if (g.R == 1)  // (N, S, B, Hn, D): rank j gets heads j of every row
    return aten::permute(ops::view(x, {g.B, n, g.H / n, g.S, g.D}), {1, 3, 0, 2, 4});
  // One repeated head per rank: rank j gets head j / R.
  return aten::expand(ops::unsqueeze(aten::permute(x, {1, 2, 0, 3}), 1), {g.H, g.R, g.S, g.B, g.D});
}

// `dst` (fresh, contiguous) viewed as `src` and filled from it.
void pack(const Tensor& dst, const Tensor& src) {
  Tensor shaped = ops::view(dst, src.sizes());
  ops::copy_(shaped, src);
}

// One exchange in flight: its group, its packed send buffer and the unwaited
// all-to-all's output; finish() waits and returns the result.
struct Pending {
  Geometry g;
  bool to_heads = true;
  std::vector<int64_t> lengths;  // empty: S/N each
  int64_t rank = 0;
  Tensor send, recv;
};

// Packs x in the order the receivers want and starts the all-to-all. Ranks of
// different lengths (non-causal joint streams): seq -> heads sends equal
// parts and receives each rank's rows, heads -> seq the reverse; the orders
// are those of the even case, so the results have its strides.
Pending start(const Group& group, const Tensor& x, const Geometry& g, bool to_heads,
              const std::vector<int64_t>& lengths) {
  Pending p{g, to_heads, lengths, group.rank, {}, {}};
  const int64_t n = g.n;
  std::vector<int64_t> in_splits(n), out_splits(n);
  if (lengths.empty() || to_heads) {
    const Tensor src = send_view(x, g, to_heads);
    if (n > 1 && src.is_contiguous()) {
      p.send = ops::reshape(src, {-1});  // already in send order: no copy
    } else {
      p.send = ops::new_empty(x, {src.numel()});
      pack(p.send, src);
    }
    for (int64_t j = 0; j < n; ++j) in_splits[j] = out_splits[j] = p.send.numel() / n;
    if (!lengths.empty()) {
      const int64_t per_row = g.B * (g.H * g.R / n) * g.D;
      for (int64_t j = 0; j < n; ++j) out_splits[j] = lengths[j] * per_row;
    }
  } else {
    // Rows of rank j for every head: (H, B, L_j, D) per destination.
    p.send = ops::new_empty(x, {x.numel()});
    Tensor whole = x;
    int64_t offset = 0, row = 0;
    for (int64_t j = 0; j < n; ++j) {
      const Tensor rows = aten::permute(ops::narrow(whole, 2, row, lengths[j]), {1, 0, 2, 3});
      pack(ops::narrow(p.send, 0, offset, rows.numel()), rows);
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
  g_bytes_sent += (p.send.numel() - in_splits[p.rank]) *
                  static_cast<int64_t>(p.send.element_size());
  // The 1-D buffers' rows are elements: the splits count elements.
  p.recv = all_to_all_split(group, p.send, out_splits, in_splits);
  return p;
}

Tensor finish(Pending& p) {
  wait(p.recv);
  const Geometry& g = p.g;
  const int64_t n = g.n;
  if (p.to_heads) {  // (S_full, B, Hn, D) -> (B, Hn, S_full, D)
    int64_t total = g.S * n;
    if (!p.lengths.empty()) {
      total = 0;
      for (const int64_t l : p.lengths) total += l;
    }
    const int64_t hn = g.H * g.R / n;
    return aten::permute(ops::view(p.recv, {total, g.B, hn, g.D}), {1, 2, 0, 3});
  }
  // (H_out * R, B, S/N, D) -> (B, H_out, S/N, D)
  const int64_t s = p.lengths.empty() ? g.S / n : p.lengths[p.rank], h_out = g.H * n / g.R;
  if (g.R == 1) return aten::permute(ops::view(p.recv, {h_out, g.B, s, g.D}), {1, 0, 2, 3});
  const std::vector<int64_t> repeats_dim{1};
  const Tensor summed = ops::sum(ops::view(p.recv, {h_out, g.R, g.B, s, g.D}), Sizes(repeats_dim));
  return aten::permute(summed, {1, 0, 2, 3});
}

// Validates every tensor, then one handshake for the call: every rank
// raises alike or none does. Without `handshake` (a call that another op's
// handshake covers) the checks raise here.
std::vector<Geometry> checked(const Group& group, const char* op, const std::vector<Tensor>& xs,
                              bool to_heads, const std::vector<int64_t>& head_repeats,
                              const std::vector<int64_t>& lengths, bool handshake) {
  std::vector<Geometry> gs;
  if (!handshake) {
    for (size_t i = 0; i < xs.size(); ++i)
      gs.push_back(check(xs[i], group.size, to_heads, head_repeats[i], lengths, group.rank));
    return gs;
  }
  Handshake hs(op);
  hs.validate([&] {
    CallSignature& sig = hs.sig();
    for (size_t i = 0; i < xs.size(); ++i) {
      gs.push_back(check(xs[i], group.size, to_heads, head_repeats[i], lengths, group.rank));
      // With lengths the ranks' rows differ by design: compare the lengths instead.
      const char* name = xs.size() == 1 ? "x" : i == 0 ? "q" : i == 1 ? "k" : "v";
      sig.add_meta(name, xs[i], lengths.empty() ? -1 : 2);
      sig.add("head_repeat[" + std::to_string(i) + "]", head_repeats[i]);
    }
    for (size_t r = 0; r < lengths.size(); ++r)
      sig.add("lengths[" + std::to_string(r) + "]", lengths[r]);
    sig.add_flag("to_heads", to_heads);
  });
  hs.exchange(group);
  return gs;
}

}  // namespace

int64_t bytes_sent(bool reset) { return reset ? g_bytes_sent.exchange(0) : g_bytes_sent.load(); }

Tensor reshard(const Tensor& x, std::string_view group_name, bool to_heads, int64_t head_repeat,
               const std::vector<int64_t>& lengths, bool handshake) {
  const Group group = resolve_group(group_name);
  const Geometry g =
      checked(group, "ulysses_reshard", {x}, to_heads, {head_repeat}, lengths, handshake).front();
  Pending p = start(group, x, g, to_heads, lengths);
  return finish(p);
}

std::vector<Tensor> reshard_many(const std::vector<Tensor>& xs, std::string_view group_name,
                                 bool to_heads, const std::vector<int64_t>& head_repeats,
                                 const std::vector<int64_t>& lengths, bool handshake) {
  const Group group = resolve_group(group_name);
  CPLIB_CHECK_VALUE(head_repeats.size() == xs.size(),
                    "cplib.ulysses_reshard_qkv: ", head_repeats.size(), " head repeats for ",
                    xs.size(), " tensors");
  const std::vector<Geometry> gs = checked(group, "ulysses_reshard_qkv", xs, to_heads, head_repeats,
                                           lengths, handshake);
  // All exchanges in flight at once: packing the next overlaps the previous.
  std::vector<Pending> pending;
  for (size_t i = 0; i < xs.size(); ++i)
    pending.push_back(start(group, xs[i], gs[i], to_heads, lengths));
  std::vector<Tensor> out;
  for (Pending& p : pending) out.push_back(finish(p));
  return out;
}

}  // namespace cplib::ulysses
