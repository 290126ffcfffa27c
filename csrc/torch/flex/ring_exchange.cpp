// The flex-attention ring's communication (cplib/flex/ring.py drives the
// loop in Python, because flex_attention is a Python higher-order op):
//
//   flex_ring_begin   the handshake of one ring call (fwd+bwd): every rank
//                     checks q, k, v and the described call (mask shape,
//                     block size, plan hash, ...) before the first exchange,
//                     and all raise alike or none does (a rank's own error,
//                     found while its call was traced, comes as a field).
//                     Returns an empty token that the first exchange takes.
//   flex_ring_shift   one step's exchange: `send` (flat) to rank `dst`,
//                     `recv_numel` elements from rank `src`, as a split
//                     all-to-all that every rank joins (one non-empty peer
//                     each way; every torch, every group), waited here.
//                     Returns (received, token). The `after` argument is the
//                     previous exchange's token (or the begin op's): a data
//                     dependence that keeps the exchanges of a compiled graph
//                     in program order on every rank.
//   flex_ring_end     a copy of `x` that depends on the last exchange, so
//                     that a compiled graph keeps every exchange of the
//                     chain even on a rank that reads none of their outputs
//                     (it receives nothing at the last steps).
//
// Every op is self-contained (it posts and waits its own collective), so a
// compiled graph can move compute around it but never split it. None is
// marked as having side effects: a graph partitioner copies such ops into
// both the forward and the backward graph.
#include <algorithm>
#include <atomic>
#include <string>
#include <tuple>
#include <vector>

#include "comm/collectives.h"
#include "comm/handshake.h"
#include "common/aten.h"
#include "common/checks.h"
#include "common/format.h"
#include "common/stable.h"
#include "flex/calls_begun.h"

namespace cplib::flex {

// Per thread: the threaded process group runs every rank in one process.
thread_local int64_t t_calls_begun = 0;

void note_call_begun() { ++t_calls_begun; }

namespace {

std::atomic<int64_t> g_bytes_received{0};
const std::string kErrorField = "error: ";

void check_qkv(const Tensor& q, const Tensor& k, const Tensor& v) {
  for (const auto& [name, t] :
       {std::pair{"query", &q}, std::pair{"key", &k}, std::pair{"value", &v}}) {
    CPLIB_CHECK_VALUE(t->dim() == 4, "cplib.flex_ring: ", name, " must be 4-D (B, H, S, D), got ",
                      t->sizes());
    CPLIB_CHECK_VALUE(is_floating(t->scalar_type()), "cplib.flex_ring: ", name, " has dtype ",
                      torch::headeronly::toString(t->scalar_type()), "; expected a floating dtype");
    CPLIB_CHECK_VALUE(t->device() == q.device(), "cplib.flex_ring: ", name, " is on ", t->device(),
                      " but query is on ", q.device());
  }
  CPLIB_CHECK_VALUE(q.is_cpu() || q.is_cuda(), "cplib.flex_ring: unsupported device ", q.device());
}

Tensor flex_ring_begin(Tensor q, Tensor k, Tensor v, std::vector<std::string> names,
                       std::vector<int64_t> values, std::string group_name) {
  const Group group = resolve_group(group_name);
  note_call_begun();
  Handshake hs("flex_ring");
  // A field named "error: <message>" (its value an ErrorKind) is this rank's
  // error, found while the call was traced: every rank raises it here.
  for (size_t i = 0; i < names.size() && i < values.size(); ++i) {
    if (names[i].rfind(kErrorField, 0) != 0) continue;
    const bool known = values[i] > 0 && values[i] <= static_cast<int64_t>(ErrorKind::runtime);
    hs.fail(known ? static_cast<ErrorKind>(values[i]) : ErrorKind::runtime,
            names[i].substr(kErrorField.size()));
  }
  hs.validate([&] {
    CPLIB_CHECK_VALUE(names.size() == values.size(), "cplib.flex_ring_begin: ", names.size(),
                      " field names for ", values.size(), " values");
    check_qkv(q, k, v);
    hs.sig().add_meta("query", q);
    hs.sig().add_meta("key", k);
    hs.sig().add_meta("value", v);
    for (size_t i = 0; i < names.size(); ++i) hs.sig().add(names[i], values[i]);
  });
  hs.exchange(group);
  return aten::empty({0}, aten::opts_of(q));
}

std::tuple<Tensor, Tensor> flex_ring_shift(Tensor send, Tensor after, int64_t dst,
                                           int64_t recv_numel, int64_t src,
                                           std::string group_name) {
  (void)after;  // only orders this exchange after the previous one
  const Group group = resolve_group(group_name);
  CPLIB_CHECK_VALUE(dst >= 0 && dst < group.size && src >= 0 && src < group.size,
                    "cplib.flex_ring_shift: peers ", dst, " and ", src,
                    " are not ranks of a group of ", group.size);
  CPLIB_CHECK_VALUE(recv_numel >= 0, "cplib.flex_ring_shift: recv_numel=", recv_numel,
                    " is negative");
  CPLIB_CHECK_VALUE(send.dim() == 1 && send.is_contiguous(),
                    "cplib.flex_ring_shift: send must be a flat contiguous buffer, got ",
                    send.sizes());
  // A world of one has no other rank: the ring never schedules a step there.
  CPLIB_CHECK_VALUE(group.size > 1 || (send.numel() == 0 && recv_numel == 0),
                    "cplib.flex_ring_shift: a group of one rank exchanges nothing");
  // The token is its own (empty) tensor, so that the next exchange's
  // dependence on this one does not keep the received block alive.
  Tensor token = aten::empty({0}, aten::opts_of(send));
  if (group.size == 1) return {aten::empty({0}, aten::opts_of(send)), token};
  std::vector<int64_t> in_splits(static_cast<size_t>(group.size), 0), out_splits(in_splits);
  if (send.numel() > 0) in_splits[dst] = send.numel();
  if (recv_numel > 0) out_splits[src] = recv_numel;
  Tensor out = all_to_all_split(group, send, out_splits, in_splits);
  wait(out);
  if (recv_numel == 0) return {aten::empty({0}, aten::opts_of(send)), token};
  g_bytes_received += aten::nbytes(out);
  return {out, token};
}

Tensor flex_ring_end(Tensor x, Tensor after) {
  (void)after;  // only keeps the exchanges before it alive and in order
  Tensor out = aten::empty(aten::sizes_of(x), aten::opts_of(x));
  aten::copy_(out, x);
  return out;
}

int64_t flex_ring_debug_bytes(bool reset) {
  return reset ? g_bytes_received.exchange(0) : g_bytes_received.load();
}

int64_t flex_debug_calls_begun() { return t_calls_begun; }

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(cplib_c, m) {
  m.def(
      "flex_ring_begin(Tensor q, Tensor k, Tensor v, str[] names, int[] values, "
      "str group_name) -> Tensor");
  m.def(
      "flex_ring_shift(Tensor send, Tensor after, int dst, int recv_numel, int src, "
      "str group_name) -> (Tensor, Tensor)");
  m.def("flex_ring_end(Tensor x, Tensor after) -> Tensor");
  m.def("flex_ring_debug_bytes(bool reset=False) -> int");
  m.def("flex_debug_calls_begun() -> int");
}

STABLE_TORCH_LIBRARY_IMPL(cplib_c, CPU, m) {
  m.impl("flex_ring_begin", CPLIB_BOX(&flex_ring_begin));
  m.impl("flex_ring_shift", CPLIB_BOX(&flex_ring_shift));
  m.impl("flex_ring_end", CPLIB_BOX(&flex_ring_end));
}

STABLE_TORCH_LIBRARY_IMPL(cplib_c, CompositeExplicitAutograd, m) {
  m.impl("flex_ring_debug_bytes", CPLIB_BOX(&flex_ring_debug_bytes));
  m.impl("flex_debug_calls_begun", CPLIB_BOX(&flex_debug_calls_begun));
}

#ifdef CPLIB_WITH_CUDA
STABLE_TORCH_LIBRARY_IMPL(cplib_c, CUDA, m) {
  m.impl("flex_ring_begin", CPLIB_BOX(&flex_ring_begin));
  m.impl("flex_ring_shift", CPLIB_BOX(&flex_ring_shift));
  m.impl("flex_ring_end", CPLIB_BOX(&flex_ring_end));
}
#endif

}  // namespace cplib::flex
