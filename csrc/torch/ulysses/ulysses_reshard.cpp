// The Ulysses all-to-all. One copy packs the send buffer in the order the
// receivers want (per destination rank: its heads for seq -> heads, its rows
// for heads -> seq); the receive buffer is then the result as it stands, a
// strided view with no unpacking (GQA's gradient sums the repeated heads).
#include "ulysses/ulysses.h"

#include <atomic>
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
Geometry check(const at::Tensor& x, int64_t n, bool to_heads, int64_t repeat) {
  const char* op = to_heads ? "cplib.ulysses_reshard (seq -> heads)"
                            : "cplib.ulysses_reshard (heads -> seq)";
  TORCH_CHECK_VALUE(x.dim() == 4, op, ": expected a (B, H, S, D) tensor, got shape ", x.sizes());
  TORCH_CHECK_VALUE(x.device().is_cpu() || x.device().is_cuda(), op, ": unsupported device ",
                    x.device());
  TORCH_CHECK_VALUE(repeat >= 1, op, ": head_repeat=", repeat, " must be >= 1");
  Geometry g{n, x.size(0), x.size(1), x.size(2), x.size(3), repeat};
  if (to_heads) {
    TORCH_CHECK_VALUE((g.H * repeat) % n == 0, op, ": ", g.H, " heads",
                      repeat > 1 ? " (repeated " + std::to_string(repeat) + "x)" : "",
                      " cannot be split over the Ulysses degree ", n);
    TORCH_CHECK_VALUE(repeat == 1 || g.H * repeat == n, op, ": head_repeat=", repeat,
                      " must bring the ", g.H, " heads to exactly the Ulysses degree ", n);
  } else {
    TORCH_CHECK_VALUE(g.S % n == 0, op, ": sequence length ", g.S,
                      " cannot be split over the Ulysses degree ", n);
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

}  // namespace

int64_t bytes_sent(bool reset) { return reset ? g_bytes_sent.exchange(0) : g_bytes_sent.load(); }

at::Tensor reshard(const at::Tensor& x, std::string_view group_name, bool to_heads,
                   int64_t head_repeat) {
  PG pg = resolve_group(group_name);
  Handshake hs("ulysses_reshard");
  Geometry g;
  hs.validate([&] {
    g = check(x, pg->getSize(), to_heads, head_repeat);
    hs.sig().add_meta("x", x);
    hs.sig().add_flag("to_heads", to_heads);
    hs.sig().add("head_repeat", head_repeat);
  });
  hs.exchange(group_name, pg, x.device());
  const int64_t n = g.n;

  const at::Tensor src = send_view(x, g, to_heads);
  at::Tensor send;
  if (n > 1 && src.is_contiguous()) {
    send = src.reshape({-1});  // already in send order: no copy
  } else {
    send = at::empty({src.numel()}, x.options());
    send.view(src.sizes()).copy_(src);
  }
  at::Tensor recv = send;  // a world of one keeps its (fresh) packed copy
  if (n > 1) {
    recv = at::empty_like(send);
    std::vector<int64_t> splits(n, send.numel() / n);
    g_bytes_sent += static_cast<int64_t>(send.nbytes()) / n * (n - 1);
    wait(all_to_all_split(pg, recv, send, splits, splits));
  }

  if (to_heads) {  // (S_full, B, Hn, D) -> (B, Hn, S_full, D)
    const int64_t hn = g.H * g.R / n;
    return recv.view({g.S * n, g.B, hn, g.D}).permute({1, 2, 0, 3});
  }
  // (H_out * R, B, S/N, D) -> (B, H_out, S/N, D)
  const int64_t s = g.S / n, h_out = g.H * n / g.R;
  if (g.R == 1) return recv.view({h_out, g.B, s, g.D}).permute({1, 0, 2, 3});
  at::Tensor summed = at::empty({h_out, g.B, s, g.D}, x.options());
  at::sum_out(summed, recv.view({h_out, g.R, g.B, s, g.D}), {1});
  return summed.permute({1, 0, 2, 3});
}

}  // namespace cplib::ulysses
