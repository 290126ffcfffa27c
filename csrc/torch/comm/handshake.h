// The handshake: before a communicating op's first collective, every rank
// all-gathers one fixed-width record: its own validation result (ok, or the
// error's class and message), the op's name, the group's name, a description
// of the call (named integers that must be equal on every rank) and its local
// lengths. Every rank then raises the same error when any rank's input is
// invalid or the ranks disagree, instead of one rank raising while the others
// wait in (or crash inside) a collective. The gathered local lengths stay
// available to the op.
//
// The record travels in host memory, over the group itself when its backend
// takes CPU tensors (gloo, the threaded group, "cpu:gloo,cuda:nccl") or over
// the CPU side group that cplib.register_group made for an NCCL group: the
// handshake never waits for the GPU. An NCCL group with no side group falls
// back to a CUDA buffer read back to the host (a host-device sync per op; the
// Python side warns once per group and names register_group).
//
// On by default; CPLIB_CHECK_CONSISTENCY=0 turns it off: no all-gather, and a
// rank's invalid input then raises on that rank only.
#pragma once

#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "comm/collectives.h"
#include "common/stable.h"

namespace cplib {

bool handshake_enabled();

// How a field's value reads in an error message.
enum class FieldKind : int64_t { integer, boolean, dtype, device, float64, hash };

// Named integers that must be equal on every rank of the group. Adding an
// argument of an op to its handshake is one add() line.
class CallSignature {
 public:
  struct Field {
    std::string name;
    int64_t value;
    FieldKind kind;
  };

  void add(std::string name, int64_t value, FieldKind kind = FieldKind::integer);
  void add_flag(std::string name, bool value) { add(std::move(name), value, FieldKind::boolean); }
  // `name` (None or the float's bits): one field.
  void add_optional_float(std::string name, std::optional<double> value);
  // Rank, sizes (`skip_dim` as -1), dtype and device type of `t`, or that it is None.
  void add_meta(const std::string& name, const Tensor& t, int64_t skip_dim = -1);
  // A 64-bit hash of the values of an integer tensor (cu_seqlens, say): its
  // values are read (a host copy: a sync for a CUDA tensor; prefer the
  // vector overload with a host copy the op already has), so call it after
  // `t` was validated. A meta tensor hashes as its size alone.
  void add_values_hash(const std::string& name, const Tensor& t);
  void add_values_hash(const std::string& name, const std::vector<int64_t>& values);

  const std::vector<Field>& fields() const { return fields_; }

 private:
  std::vector<Field> fields_;
};

class Handshake {
 public:
  explicit Handshake(std::string op) : op_(std::move(op)) {}

  CallSignature& sig() { return sig_; }
  // This rank's local lengths (at most kMaxLengths), gathered for the op.
  void set_lengths(std::vector<int64_t> lengths);

  // Runs `check` (validation and sig() building), keeping what it throws as
  // this rank's error instead of raising it now. Later calls are skipped once
  // one failed.
  template <class F>
  void validate(F&& check) {
    if (failed()) return;
    try {
      check();
    } catch (...) {
      record(std::current_exception());
    }
  }
  // An error found elsewhere (the Python wrappers' checks).
  void fail(ErrorKind kind, std::string message);
  bool failed() const { return kind_ != ErrorKind::none; }

  // The all-gather over the group's handshake route (see HandshakeRoute),
  // then the verdict: the same exception on every rank, or a normal return.
  // Off, or in a world of one, this rank's own error is rethrown as it was.
  void exchange(const Group& group);

  // After exchange: rank r's local lengths (only this rank's, as rank 0's,
  // when nothing was exchanged).
  std::vector<int64_t> lengths(int64_t rank) const;
  bool exchanged() const { return !table_.empty(); }

  static constexpr int64_t kMaxLengths = 8;

 private:
  void record(std::exception_ptr e);
  [[noreturn]] void rethrow_local() const;

  // exchange's steps: this rank's record, the all-gather into table_, then
  // the checks of the table (each raises the same error on every rank).
  std::vector<int64_t> own_record(const std::string& group_name) const;
  void gather(const Group& group, const std::vector<int64_t>& mine);
  void check_magic() const;
  void raise_failures() const;
  void check_same_op_and_group() const;
  void check_same_fields() const;
  // Rank `rank`'s slot `index` of the table, and the string from it on.
  int64_t slot(int64_t rank, int64_t index) const;
  std::string string_of(int64_t rank, int64_t index, int64_t bytes) const;

  std::string op_;
  CallSignature sig_;
  std::vector<int64_t> lengths_;
  ErrorKind kind_ = ErrorKind::none;
  std::string message_;
  std::exception_ptr error_;
  int64_t ranks_ = 1;
  std::vector<int64_t> table_;  // ranks_ x record width, after exchange
};

// Where the handshakes of a group travel: `via`, a group over the same ranks
// in the same order (the first such group, so that ranks passing different
// group objects over the same ranks meet in one collective and are told so;
// or the CPU side group of an NCCL group), and the device of the record
// buffer: CPU whenever `via` takes CPU tensors.
// Internal to the extension (torch's stable types are hidden).
#pragma GCC visibility push(hidden)
struct HandshakeRoute {
  Group via;
  Device device{DeviceType::CPU};
};
HandshakeRoute handshake_route(const Group& group);
#pragma GCC visibility pop

// Set by the Python side (cplib/comm/native.py) for the group whose token
// (Group::token) is `token`: routes are keyed by the group object, not by
// its name, which torch reuses after destroy_process_group and a new init.
// `on_host`: 1 when `via` takes CPU tensors, 0 when it does not (NCCL
// without a side group: the fallback), -1 to derive it from the group's
// backend. `side`: `via` is a side group that cplib made (never destroyed
// before the group), so it is not resolved again at each handshake.
void register_handshake_group(int64_t token, const std::string& via, int64_t on_host, bool side);

// Handshakes (all-gathers) this process has made since the last reset: a
// debug counter for tests and benchmarks.
int64_t handshake_count(bool reset);

}  // namespace cplib
