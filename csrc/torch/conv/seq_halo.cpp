// cplib_c::seq_halo: the causal halo of a sequence-sharded tensor, for the
// short causal convolutions of hybrid models under context parallelism
// (cplib/hybrid/halo.py). tp_convolution's neighbour exchange
// (conv/tp_conv_halo.h) brought to the sequence dim and its two layouts:
//
//   sequential (first_len < 0): rank r holds one piece, chunk r; it needs the
//     last `halo` positions of rank r - 1's piece:  ext = [h | x]
//   head-tail (first_len >= 0): rank r holds chunks r and 2N-1-r, the first
//     `first_len` positions being chunk r; chunk r needs the tail of rank
//     r - 1's first piece, chunk 2N-1-r the tail of rank r + 1's second piece
//     (on rank N-1 the tail of its own first piece):
//                                              ext = [h1 | x[:first] | h2 | x[first:]]
//
// Halos before the sequence start are zero (a causal conv's own padding). A
// causal conv of `ext` then gives each piece's exact outputs after its halo.
// The backward returns the halos' gradients to their owners, who add them
// to the tails they sent.
#include <string>

#include "comm/handshake.h"
#include "common/aten.h"
#include "common/checks.h"
#include "conv/tp_conv_halo.h"

namespace cplib {
namespace {

struct SeqHalo {
  Group group;
  int64_t dim = 0, halo = 0, length = 0, first = 0;
  bool head_tail = false;

  int64_t rank() const { return group.rank; }
  bool has_left() const { return group.rank > 0; }
  bool has_right() const { return group.rank + 1 < group.size; }
  // Where the second piece's halo and the second piece start in ext.
  int64_t second_halo_at() const { return halo + first; }
  int64_t second_at() const { return 2 * halo + first; }
  int64_t extended_length() const { return length + (head_tail ? 2 : 1) * halo; }
};

void check_local(const Tensor& t, int64_t dim, int64_t halo, int64_t first_len, int64_t length) {
  CPLIB_CHECK_VALUE(halo >= 0, "cplib.seq_halo: halo=", halo, " must be >= 0");
  CPLIB_CHECK_VALUE(is_floating(t.scalar_type()), "cplib.seq_halo: the tensor must be floating ",
                    "point, got ", t.scalar_type());
  if (first_len < 0) {
    CPLIB_CHECK_VALUE(length >= halo, "cplib.seq_halo: this rank's ", length,
                      " positions are fewer than the halo of ", halo,
                      " its neighbour needs (each shard must hold at least kernel - 1 positions)");
    return;
  }
  CPLIB_CHECK_VALUE(first_len <= length, "cplib.seq_halo: first_len=", first_len,
                    " exceeds this rank's ", length, " positions");
  CPLIB_CHECK_VALUE(first_len >= halo && length - first_len >= halo,
                    "cplib.seq_halo: this rank's head-tail pieces (", first_len, " and ",
                    length - first_len, " positions) must each hold at least the halo of ", halo,
                    " (kernel - 1) positions");
}

// `t` is x (forward) or the gradient of ext (backward): its length along
// dim is the local one, or the extended one.
SeqHalo resolve(const Tensor& t, int64_t dim, int64_t halo, int64_t first_len,
                const std::string& group_name, bool extended, bool handshake) {
  SeqHalo s;
  s.group = resolve_group(group_name);
  s.head_tail = first_len >= 0;
  auto check = [&] {
    s.dim = checked_dim(dim, t.dim(), "dim");
    const int64_t pad = extended ? (s.head_tail ? 2 : 1) * halo : 0;
    s.length = t.size(s.dim) - pad;
    check_local(t, s.dim, halo, first_len, s.length);
  };
  if (!handshake) {
    check();
  } else {
    Handshake hs("seq_halo");
    hs.validate([&] {
      check();
      CallSignature& sig = hs.sig();
      sig.add_meta("x", t, s.dim);
      sig.add("dim", s.dim);
      sig.add("halo", halo);
      sig.add_flag("head_tail", s.head_tail);
      hs.set_lengths({s.length});
    });
    hs.exchange(s.group);
  }
  s.halo = halo;
  s.first = s.head_tail ? first_len : s.length;
  return s;
}

Tensor seq_halo_impl(const Tensor& x, int64_t dim, int64_t halo, int64_t first_len,
                     const std::string& group_name) {
  const SeqHalo s = resolve(x, dim, halo, first_len, group_name, false, true);
  const int64_t h = s.halo, d = s.dim;
  std::vector<int64_t> sizes = aten::sizes_of(x);
  sizes[d] = s.extended_length();
  Tensor ext = aten::empty(sizes, aten::opts_of(x));
  const bool talk = h > 0 && s.group.size > 1;
  // Rightward: the tail of the first piece (the second piece's tail never
  // goes right: the next chunk after it is held by rank r - 1). Leftward
  // (head-tail only): the tail of the second piece, for rank r - 1's second.
  Slab right = talk && s.has_right() ? Slab{x, s.first - h, h} : Slab{};
  Slab left = talk && s.head_tail && s.has_left() ? Slab{x, s.length - h, h} : Slab{};
  NeighbourExchange ex(s.group, d, x, left, right, talk && s.has_left() ? h : 0,
                       talk && s.head_tail && s.has_right() ? h : 0, talk && s.head_tail ? h : 0,
                       talk ? h : 0);
  // Overlapped with the messages: the pieces and the halos known locally.
  aten::copy_(aten::narrow(ext, d, h, s.first), aten::narrow(x, d, 0, s.first));
  if (!s.has_left()) aten::zero_(aten::narrow(ext, d, 0, h));
  if (s.head_tail) {
    aten::copy_(aten::narrow(ext, d, s.second_at(), s.length - s.first),
                aten::narrow(x, d, s.first, s.length - s.first));
    if (!s.has_right())  // chunk N follows chunk N-1 on the same rank
      aten::copy_(aten::narrow(ext, d, s.second_halo_at(), h), aten::narrow(x, d, s.first - h, h));
  }
  ex.wait();
  if (talk && s.has_left()) unpack_slab(ext, d, 0, ex.from_left);
  if (talk && s.head_tail && s.has_right()) unpack_slab(ext, d, s.second_halo_at(), ex.from_right);
  return ext;
}

Tensor seq_halo_backward_impl(const Tensor& grad_ext, int64_t dim, int64_t halo, int64_t first_len,
                              const std::string& group_name, bool handshake) {
  const SeqHalo s = resolve(grad_ext, dim, halo, first_len, group_name, true, handshake);
  const int64_t h = s.halo, d = s.dim;
  std::vector<int64_t> sizes = aten::sizes_of(grad_ext);
  sizes[d] = s.length;
  Tensor grad_x = aten::empty(sizes, aten::opts_of(grad_ext));
  const bool talk = h > 0 && s.group.size > 1;
  // Each halo's gradient goes back where the halo came from.
  Slab left = talk && s.has_left() ? Slab{grad_ext, 0, h} : Slab{};
  Slab right = talk && s.head_tail && s.has_right() ? Slab{grad_ext, s.second_halo_at(), h}
                                                    : Slab{};
  NeighbourExchange back(s.group, d, grad_ext, left, right,
                         talk && s.head_tail && s.has_left() ? h : 0, talk && s.has_right() ? h : 0,
                         talk ? h : 0, talk && s.head_tail ? h : 0);
  aten::copy_(aten::narrow(grad_x, d, 0, s.first), aten::narrow(grad_ext, d, h, s.first));
  if (s.head_tail) {
    aten::copy_(aten::narrow(grad_x, d, s.first, s.length - s.first),
                aten::narrow(grad_ext, d, s.second_at(), s.length - s.first));
    if (!s.has_right() && h > 0)
      aten::add_(aten::narrow(grad_x, d, s.first - h, h),
                 aten::narrow(grad_ext, d, s.second_halo_at(), h));
  }
  back.wait();
  // The tails this rank sent: the first piece's went right, the second's left.
  if (talk && s.has_right()) aten::add_(aten::narrow(grad_x, d, s.first - h, h), back.from_right);
  if (talk && s.head_tail && s.has_left())
    aten::add_(aten::narrow(grad_x, d, s.length - h, h), back.from_left);
  return grad_x;
}

Tensor seq_halo(Tensor x, int64_t dim, int64_t halo, int64_t first_len, std::string group_name) {
  return seq_halo_impl(x, dim, halo, first_len, group_name);
}

Tensor seq_halo_backward(Tensor grad_ext, int64_t dim, int64_t halo, int64_t first_len,
                         std::string group_name) {
  return seq_halo_backward_impl(grad_ext, dim, halo, first_len, group_name, true);
}

// Internal: the backward through autograd, covered by its forward's handshake.
Tensor seq_halo_backward_covered(Tensor grad_ext, int64_t dim, int64_t halo, int64_t first_len,
                                 std::string group_name) {
  return seq_halo_backward_impl(grad_ext, dim, halo, first_len, group_name, false);
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(cplib_c, m) {
  m.def("seq_halo(Tensor x, int dim, int halo, int first_len, str group_name) -> Tensor");
  m.def(
      "seq_halo_backward(Tensor grad_ext, int dim, int halo, int first_len, str group_name) "
      "-> Tensor");
  m.def(
      "seq_halo_backward_covered(Tensor grad_ext, int dim, int halo, int first_len, "
      "str group_name) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(cplib_c, CPU, m) {
  m.impl("seq_halo", CPLIB_BOX(&seq_halo));
  m.impl("seq_halo_backward", CPLIB_BOX(&seq_halo_backward));
  m.impl("seq_halo_backward_covered", CPLIB_BOX(&seq_halo_backward_covered));
}

#ifdef CPLIB_WITH_CUDA
STABLE_TORCH_LIBRARY_IMPL(cplib_c, CUDA, m) {
  m.impl("seq_halo", CPLIB_BOX(&seq_halo));
  m.impl("seq_halo_backward", CPLIB_BOX(&seq_halo_backward));
  m.impl("seq_halo_backward_covered", CPLIB_BOX(&seq_halo_backward_covered));
}
#endif

}  // namespace cplib
