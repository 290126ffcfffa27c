#include "comm/handshake.h"

#include "common/format.h"

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>
#include <unordered_map>

namespace cplib {
namespace {

// One record, in int64 slots. Fixed width, so that ranks that disagree on
// anything still make one matching collective.
constexpr int64_t kMagic = 0x63706c6962680001;  // "cplibh", wire version 1
constexpr int64_t kNameBytes = 48;
constexpr int64_t kMessageBytes = 384;
constexpr int64_t kFields = 128;  // a longer signature folds its tail into the last slot
enum Slot : int64_t {
  kMagicSlot = 0,
  kStatus,
  kFieldCount,
  kLengthCount,
  kOpName,
  kGroupName = kOpName + kNameBytes / 8,
  kLengths = kGroupName + kNameBytes / 8,
  kFieldSlots = kLengths + Handshake::kMaxLengths,
  kMessage = kFieldSlots + kFields,
  kWidth = kMessage + kMessageBytes / 8,
};

constexpr uint64_t kFnvBasis = 14695981039346656037ull;

uint64_t fnv1a(uint64_t h, int64_t v) {
  for (int b = 0; b < 8; ++b) {
    h ^= static_cast<uint64_t>(v >> (8 * b)) & 0xffu;
    h *= 1099511628211ull;
  }
  return h;
}

void put_string(int64_t* slots, int64_t bytes, std::string_view s) {
  std::memset(slots, 0, static_cast<size_t>(bytes));
  std::memcpy(slots, s.data(), std::min<size_t>(s.size(), static_cast<size_t>(bytes)));
}

std::string get_string(const int64_t* slots, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(slots);
  return std::string(p, strnlen(p, static_cast<size_t>(bytes)));
}

struct RouteEntry {
  std::string via;
  int64_t on_host = -1;
  bool side = false;
};

std::mutex g_route_mutex;
std::unordered_map<int64_t, RouteEntry> g_routes;  // by group token
std::atomic<int64_t> g_handshakes{0};

// Unregistered (a direct op call, or a new group under an old name before
// its first registration): the group itself.
RouteEntry route_entry(const Group& group) {
  std::lock_guard<std::mutex> lock(g_route_mutex);
  auto it = g_routes.find(group.token);
  return it == g_routes.end() ? RouteEntry{group.name, -1, false} : it->second;
}

Tensor to_host_int64(const Tensor& t) {
  return torch::stable::contiguous(
      torch::stable::to(t, ScalarType::Long, std::nullopt, Device(DeviceType::CPU)));
}

template <class To, class From>
To bits_of(From v) {
  static_assert(sizeof(To) == sizeof(From));
  To out;
  std::memcpy(&out, &v, sizeof(out));
  return out;
}

std::string format_value(int64_t v, FieldKind kind) {
  switch (kind) {
    case FieldKind::boolean: return v == 0 ? "False" : v == 1 ? "True" : std::to_string(v);
    case FieldKind::dtype:
      if (v >= 0 && v < static_cast<int64_t>(ScalarType::NumOptions))
        return torch::headeronly::toString(static_cast<ScalarType>(v));
      break;
    case FieldKind::device:
      if (v >= 0 && v < static_cast<int64_t>(DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES))
        return format_device_type(static_cast<DeviceType>(v));
      break;
    case FieldKind::float64: {
      if (v == INT64_MIN) return "None";
      std::ostringstream os;
      os << bits_of<double>(v);
      return os.str();
    }
    case FieldKind::hash: {
      std::ostringstream os;
      os << "hash " << std::hex << static_cast<uint64_t>(v);
      return os.str();
    }
    case FieldKind::integer: break;
  }
  return std::to_string(v);
}

template <class F>
std::string per_rank(int64_t n, F&& value_of) {
  std::ostringstream os;
  for (int64_t r = 0; r < n; ++r) os << (r ? ", " : "") << "rank " << r << ": " << value_of(r);
  return os.str();
}

}  // namespace

bool handshake_enabled() {
  const char* v = std::getenv("CPLIB_CHECK_CONSISTENCY");
  return v == nullptr || std::strcmp(v, "0") != 0;
}

void register_handshake_group(int64_t token, const std::string& via, int64_t on_host, bool side) {
  std::lock_guard<std::mutex> lock(g_route_mutex);
  g_routes[token] = RouteEntry{via, on_host, side};
}

int64_t handshake_count(bool reset) {
  return reset ? g_handshakes.exchange(0) : g_handshakes.load();
}

HandshakeRoute handshake_route(const Group& group) {
  const RouteEntry e = route_entry(group);
  HandshakeRoute r{group, Device(DeviceType::CPU)};
  if (e.via != group.name) {
    // Over the same ranks in the same order: rank and size are the group's.
    r.via = Group{e.via, group.rank, group.size, e.on_host == 0};
    if (!e.side) {
      try {  // a first group over these ranks: it may have been destroyed since
        r.via = resolve_group(e.via);
      } catch (const Error&) {
        r.via = group;
      }
    }
  }
  // Unregistered (a direct op call), or back on the group itself: every
  // backend but NCCL takes CPU tensors.
  const bool fell_back = r.via.name == group.name && e.via != group.name;
  const bool on_host = e.on_host == -1 || fell_back ? !r.via.nccl : e.on_host == 1;
  if (!on_host) r.device = Device(DeviceType::CUDA);  // no index: the current device
  return r;
}

void CallSignature::add(std::string name, int64_t value, FieldKind kind) {
  fields_.push_back({std::move(name), value, kind});
}

void CallSignature::add_optional_float(std::string name, std::optional<double> value) {
  // INT64_MIN is the bits of -NaN with a full payload: no float a caller passes.
  add(std::move(name), value ? bits_of<int64_t>(*value) : INT64_MIN, FieldKind::float64);
}

void CallSignature::add_meta(const std::string& name, const Tensor& t, int64_t skip_dim) {
  if (!t.defined()) {
    add(name + " is not None", 0, FieldKind::boolean);
    return;
  }
  add(name + ".dim()", t.dim());
  // A skipped dim keeps its slot (value -1), so that the fields of ranks
  // that skip it and ranks that do not still line up.
  for (int64_t d = 0; d < t.dim(); ++d)
    add(name + ".size(" + std::to_string(d) + ")", d == skip_dim ? -1 : t.size(d));
  add(name + ".dtype", static_cast<int64_t>(t.scalar_type()), FieldKind::dtype);
  add(name + ".device type", static_cast<int64_t>(t.device().type()), FieldKind::device);
}

void CallSignature::add_values_hash(const std::string& name, const Tensor& t) {
  if (!t.defined()) return add_values_hash(name, std::vector<int64_t>{});
  if (t.device().type() == DeviceType::Meta)  // no values to read
    return add_values_hash(name, std::vector<int64_t>{-1, t.numel()});
  const Tensor host = to_host_int64(t);
  const int64_t* p = host.const_data_ptr<int64_t>();
  add_values_hash(name, std::vector<int64_t>(p, p + host.numel()));
}

void CallSignature::add_values_hash(const std::string& name, const std::vector<int64_t>& values) {
  uint64_t h = fnv1a(kFnvBasis, static_cast<int64_t>(values.size()));
  for (int64_t v : values) h = fnv1a(h, v);
  add(name + " (hash of its values)", static_cast<int64_t>(h), FieldKind::hash);
}

void Handshake::set_lengths(std::vector<int64_t> lengths) {
  CPLIB_ASSERT(static_cast<int64_t>(lengths.size()) <= kMaxLengths);
  lengths_ = std::move(lengths);
}

void Handshake::fail(ErrorKind kind, std::string message) {
  if (failed()) return;
  kind_ = kind == ErrorKind::none ? ErrorKind::runtime : kind;
  message_ = std::move(message);
}

void Handshake::record(std::exception_ptr e) {
  error_ = e;
  try {
    std::rethrow_exception(e);
  } catch (const Error& x) {
    fail(x.kind(), x.message());
  } catch (const std::exception& x) {
    fail(ErrorKind::runtime, x.what());
  } catch (...) {
    fail(ErrorKind::runtime, "unknown error");
  }
}

void Handshake::rethrow_local() const {
  if (error_) std::rethrow_exception(error_);
  raise(kind_, message_);
}

std::vector<int64_t> Handshake::lengths(int64_t rank) const {
  if (table_.empty()) return lengths_;
  const int64_t* rec = table_.data() + rank * kWidth;
  return std::vector<int64_t>(rec + kLengths, rec + kLengths + rec[kLengthCount]);
}

void Handshake::exchange(const Group& group) {
  ranks_ = group.size;
  if (!handshake_enabled() || ranks_ == 1) {
    if (failed()) rethrow_local();
    return;
  }
  gather(group, own_record(group.name));
  // The verdict, from the table alone: the same on every rank.
  check_magic();
  raise_failures();
  check_same_op_and_group();
  check_same_fields();
}

std::vector<int64_t> Handshake::own_record(const std::string& group_name) const {
  std::vector<int64_t> mine(kWidth, 0);
  mine[kMagicSlot] = kMagic;
  mine[kStatus] = static_cast<int64_t>(kind_);
  put_string(&mine[kOpName], kNameBytes, op_);
  put_string(&mine[kGroupName], kNameBytes, group_name);
  mine[kLengthCount] = static_cast<int64_t>(lengths_.size());
  std::copy(lengths_.begin(), lengths_.end(), mine.begin() + kLengths);
  const auto& f = sig_.fields();
  const int64_t nf = failed() ? 0 : static_cast<int64_t>(f.size());
  mine[kFieldCount] = nf;
  // The fields past the last slot but one fold into the last slot (a hash).
  uint64_t tail = kFnvBasis;
  for (int64_t i = 0; i < nf; ++i) {
    if (i < kFields - 1)
      mine[kFieldSlots + i] = f[i].value;
    else
      tail = fnv1a(tail, f[i].value);
  }
  if (nf >= kFields) mine[kFieldSlots + kFields - 1] = static_cast<int64_t>(tail);
  if (failed()) put_string(&mine[kMessage], kMessageBytes, message_);
  return mine;
}

void Handshake::gather(const Group& group, const std::vector<int64_t>& mine) {
  // The all-gather, as an all-to-all of the record repeated once per rank
  // (every backend has it; gloo's all-gather is run as one anyway), in host
  // memory unless the route has no CPU group.
  const HandshakeRoute route = handshake_route(group);
  Tensor in = torch::stable::empty({ranks_ * kWidth}, ScalarType::Long, std::nullopt,
                                   Device(DeviceType::CPU));
  auto* dst = static_cast<int64_t*>(in.mutable_data_ptr());
  for (int64_t r = 0; r < ranks_; ++r) std::copy(mine.begin(), mine.end(), dst + r * kWidth);
  const bool on_host = route.device.type() == DeviceType::CPU;
  if (!on_host) in = torch::stable::to(in, route.device);
  const std::vector<int64_t> splits(static_cast<size_t>(ranks_), kWidth);
  Tensor all = all_to_all_split(route.via, in, splits, splits);
  wait(all);
  ++g_handshakes;
  if (!on_host) all = torch::stable::to(all, Device(DeviceType::CPU));  // the fallback's sync
  table_.assign(all.const_data_ptr<int64_t>(), all.const_data_ptr<int64_t>() + ranks_ * kWidth);
}

int64_t Handshake::slot(int64_t rank, int64_t index) const { return table_[rank * kWidth + index]; }

std::string Handshake::string_of(int64_t rank, int64_t index, int64_t bytes) const {
  return get_string(&table_[rank * kWidth + index], bytes);
}

void Handshake::check_magic() const {
  for (int64_t r = 0; r < ranks_; ++r)
    CPLIB_CHECK(slot(r, kMagicSlot) == kMagic, "cplib.", op_, ": rank ", r,
                " sent no handshake "
                "(another collective, another cplib version, or CPLIB_CHECK_CONSISTENCY=0 on "
                "that rank only)");
}

void Handshake::raise_failures() const {
  std::vector<int64_t> failing;
  for (int64_t r = 0; r < ranks_; ++r)
    if (slot(r, kStatus) != 0) failing.push_back(r);
  if (failing.empty()) return;
  const int64_t r0 = failing.front();
  std::ostringstream os;
  os << "cplib." << string_of(r0, kOpName, kNameBytes) << ": invalid input on ";
  if (static_cast<int64_t>(failing.size()) == ranks_) {
    os << "every rank (rank " << r0 << "'s error)";
  } else {
    os << "rank " << r0;
    if (failing.size() > 1) {
      os << " (and rank";
      for (size_t i = 1; i < failing.size(); ++i) os << (i > 1 ? ", " : " ") << failing[i];
      os << ")";
    }
  }
  os << ": " << string_of(r0, kMessage, kMessageBytes);
  raise(static_cast<ErrorKind>(slot(r0, kStatus)), os.str());
}

void Handshake::check_same_op_and_group() const {
  const int64_t n = ranks_;
  auto op_of = [&](int64_t r) { return string_of(r, kOpName, kNameBytes); };
  for (int64_t r = 1; r < n; ++r)
    CPLIB_CHECK_VALUE(op_of(r) == op_of(0), "cplib: ranks are in different ops on one group (",
                      per_rank(n, [&](int64_t q) { return "cplib." + op_of(q); }),
                      "); every rank must make the same calls in the same order");
  auto group_of = [&](int64_t r) { return "'" + string_of(r, kGroupName, kNameBytes) + "'"; };
  for (int64_t r = 1; r < n; ++r)
    CPLIB_CHECK_VALUE(group_of(r) == group_of(0), "cplib.", op_,
                      ": ranks passed different "
                      "process groups over the same ranks (",
                      per_rank(n, group_of), "); every rank must pass the same group");
}

void Handshake::check_same_fields() const {
  // The fields in order, then their count: fields before the first
  // difference line up, so that difference has a name on every rank.
  const auto& f = sig_.fields();
  for (int64_t k = 0; k <= kFields; ++k) {
    const int64_t index = k < kFields ? kFieldSlots + k : kFieldCount;
    bool same = true;
    for (int64_t r = 1; r < ranks_ && same; ++r) same = slot(r, index) == slot(0, index);
    if (same) continue;
    std::string name = "the number of described arguments";
    FieldKind kind = FieldKind::integer;
    if (k < kFields - 1 && k < static_cast<int64_t>(f.size())) {
      name = f[k].name;
      kind = f[k].kind;
    } else if (k == kFields - 1) {
      name = "one of";
      for (size_t i = kFields - 1; i < f.size(); ++i)
        name += (i == static_cast<size_t>(kFields - 1) ? " " : ", ") + f[i].name;
      kind = FieldKind::hash;
    }
    raise(ErrorKind::value,
          str("cplib.", op_, ": ranks disagree on ", name, " (",
              per_rank(ranks_, [&](int64_t r) { return format_value(slot(r, index), kind); }),
              "); every rank must make the same call"));
  }
}

}  // namespace cplib
