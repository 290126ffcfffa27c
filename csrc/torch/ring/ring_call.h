// One ring call, as its caller made it. Every ring op (ring_sdpa, its
// backward and covered backward, ring_describe_call) takes the same
// arguments after its tensors: written once here (kRingCallArgs) and
// composed into each op's schema (ring_schema), parsed once from the op's
// stack into a RingCall (RingCall::read), which the ring passes down.
//
// The names of each choice (rotation, layout, ring pass) are defined here
// and nowhere else, the CUDA backends' in attention/backend.h: the schemas
// take them as strings, and cplib_c::ring_choices hands them all to Python
// (cplib/ring/names.py).
#pragma once

#include <array>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "attention/backend.h"
#include "common/stable.h"
#include "common/stack.h"

// Internal to the extension (torch's stable types are hidden).
#pragma GCC visibility push(hidden)

namespace cplib::ring {

// How K/V blocks travel (ring_rotate.h): "p2p", a neighbour exchange of
// batched send/recv each step (a split all-to-all on groups without
// point-to-point calls); "alltoall", a split all-to-all each step that every
// rank joins (torch's rotation); "allgather", one gather up front.
enum class Rotate : int64_t { p2p, alltoall, allgather };
inline constexpr std::array<std::string_view, 3> kRotateNames{"p2p", "alltoall", "allgather"};

// Where every rank's rows sit in the global sequence (ring_layout.h):
// rank r holds chunk r of N ("sequential"), chunks r and 2N-1-r of 2N
// ("head_tail"), those chunks of every document ("per_document"), or the
// document placement ("placement", ring_placement.h).
enum class SeqLayout : int64_t { sequential, head_tail, per_document, placement };
inline constexpr std::array<std::string_view, 4> kLayoutNames{"sequential", "head_tail",
                                                              "per_document", "placement"};

// What travels: keys and values ("kv"), the queries with the partial
// (out, lse) coming back ("q", forward only), or the one that moves fewer
// bytes ("auto", resolved per call: ring_agreed.h).
enum class Pass : int64_t { kv, q, fewer_bytes };
inline constexpr std::array<std::string_view, 3> kPassNames{"kv", "q", "auto"};

// The arguments every ring op takes after its tensors, in RingCall's order.
inline constexpr const char* kRingCallArgs =
    "str group_name, bool is_causal=False, str layout='sequential', float? scale=None, "
    "str backend='auto', str rotate='p2p', Tensor? cu_seqlens=None, int[]? window=None, "
    "int? seq_len=None, Tensor? q_positions=None, Tensor? kv_positions=None, "
    "str ring_pass='kv'";
// `head` + kRingCallArgs + `tail`: "ring_sdpa(Tensor q, Tensor k, Tensor v, "
// and ", Tensor? sinks=None) -> (Tensor out, Tensor lse)", say.
std::string ring_schema(std::string_view head, std::string_view tail);

// A choice by name, for ops outside the handshake: ValueError naming `op`
// and the value when it is none of the names.
Rotate parse_rotate(const char* op, const std::string& name);
SeqLayout parse_layout(const char* op, const std::string& name);

// The values of the integer tensors a ring plans with, on the host: each
// read at most once per op (for a tensor on the GPU, one device-to-host copy;
// cplib's Python layer passes host copies, read once per tensor version), or
// for a backward that its forward's handshake covers, the forward's own
// (Agreed, ring_agreed.h): it reads none.
struct HostValues {
  std::optional<std::vector<int64_t>> cu_seqlens, q_positions, kv_positions;
};

struct RingCall {
  std::string group_name;
  bool causal = false;
  SeqLayout layout = SeqLayout::sequential;
  std::optional<double> scale;
  int64_t backend = attention::kBackendAuto;  // attention/backend.h
  Rotate rotate = Rotate::p2p;
  std::optional<Tensor> cu_seqlens;            // global document bounds [0, ..., S]
  std::optional<std::vector<int64_t>> window;  // (left, right)
  std::optional<int64_t> seq_len;              // global S of uneven shards
  // Explicit global positions of this rank's q rows and k/v rows (both or neither).
  std::optional<Tensor> q_positions, kv_positions;
  Pass ring_pass = Pass::kv;
  // A choice whose name is none of its values ("rotate='ring' is not one of
  // ..."): raised by check_args, inside the handshake, so that every rank
  // raises it.
  std::string unknown;

  // Reads the kRingCallArgs off an op's stack, taking each value.
  static RingCall read(StackReader& in);

  bool has_positions() const { return q_positions.has_value() || kv_positions.has_value(); }
  bool head_tail() const { return layout == SeqLayout::head_tail; }
  // The values of cu_seqlens / q_positions / kv_positions, read on first use
  // (call after their dtype and shape were checked).
  const std::vector<int64_t>& cu_seqlens_values() const;
  const std::vector<int64_t>& q_positions_values() const;
  const std::vector<int64_t>& kv_positions_values() const;
  mutable HostValues host;
};

}  // namespace cplib::ring

#pragma GCC visibility pop
