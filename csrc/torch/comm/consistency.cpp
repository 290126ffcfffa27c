#include "comm/consistency.h"

#include <cstdlib>
#include <cstring>
#include <sstream>

namespace cplib {
namespace {

// Fixed width of the gathered description, so ranks that disagree on the
// number of fields still make one matching collective. Slot 0 holds the
// field count; a longer signature folds its tail into the last slot's hash.
constexpr int64_t kSlots = 48;

uint64_t fnv1a(uint64_t h, int64_t v) {
  for (int b = 0; b < 8; ++b) {
    h ^= static_cast<uint64_t>(v >> (8 * b)) & 0xffu;
    h *= 1099511628211ull;
  }
  return h;
}

constexpr uint64_t kFnvBasis = 14695981039346656037ull;

std::vector<int64_t> encode(const CallSignature& sig) {
  const auto& f = sig.fields();
  std::vector<int64_t> slots(kSlots, 0);
  slots[0] = static_cast<int64_t>(f.size());
  uint64_t tail = kFnvBasis;
  for (size_t i = 0; i < f.size(); ++i) {
    if (static_cast<int64_t>(i) + 1 < kSlots - 1)
      slots[i + 1] = f[i].second;
    else
      tail = fnv1a(tail, f[i].second);
  }
  if (static_cast<int64_t>(f.size()) + 1 >= kSlots) slots[kSlots - 1] = static_cast<int64_t>(tail);
  return slots;
}

std::string field_name(const CallSignature& sig, int64_t slot) {
  if (slot == 0) return "the number of checked fields";
  const auto& f = sig.fields();
  if (slot < kSlots - 1 && slot - 1 < static_cast<int64_t>(f.size())) return f[slot - 1].first;
  return "the trailing fields";
}

bool env_is(const char* name, const char* value) {
  const char* v = std::getenv(name);
  return v != nullptr && std::strcmp(v, value) == 0;
}

}  // namespace

bool consistency_checks_enabled() {
  return env_is("TORCH_DISTRIBUTED_DEBUG", "DETAIL") || env_is("CPLIB_CHECK_CONSISTENCY", "1");
}

void CallSignature::add(std::string name, int64_t value) {
  fields_.emplace_back(std::move(name), value);
}

void CallSignature::add_meta(const std::string& name, const at::Tensor& t) {
  if (!t.defined()) {
    add(name + " (defined)", 0);
    return;
  }
  add(name + ".dim()", t.dim());
  for (int64_t d = 0; d < t.dim(); ++d) add(name + ".size(" + std::to_string(d) + ")", t.size(d));
  add(name + ".dtype (ScalarType code)", static_cast<int64_t>(t.scalar_type()));
  add(name + ".device type", static_cast<int64_t>(t.device().type()));
}

void CallSignature::add_values_hash(const std::string& name, const at::Tensor& t) {
  uint64_t h = kFnvBasis;
  if (t.defined()) {
    const at::Tensor host = t.to(at::kCPU, at::kLong).contiguous();
    const int64_t* p = host.const_data_ptr<int64_t>();
    for (int64_t i = 0; i < host.numel(); ++i) h = fnv1a(h, p[i]);
  }
  add(name + " (hash of its values)", static_cast<int64_t>(h));
}

void check_consistent(const PG& pg, std::string_view op, const CallSignature& sig,
                      const at::Device& device) {
  const int64_t n = pg->getSize();
  if (n == 1) return;
  const std::vector<int64_t> mine = encode(sig);
  at::Tensor in = at::tensor(mine, at::TensorOptions().dtype(at::kLong)).to(device);
  at::Tensor all = at::empty({n * kSlots}, in.options());
  wait(all_gather_dim0(pg, all, in));
  const at::Tensor host = all.cpu().view({n, kSlots});
  const int64_t* g = host.const_data_ptr<int64_t>();
  // The field count last: fields before the first difference line up, so
  // that difference has a name on every rank.
  for (int64_t k = 1; k <= kSlots; ++k) {
    const int64_t s = k % kSlots;
    bool same = true;
    for (int64_t r = 1; r < n && same; ++r) same = g[r * kSlots + s] == g[s];
    if (same) continue;
    std::ostringstream values;
    for (int64_t r = 0; r < n; ++r) values << (r ? ", " : "") << "rank " << r << ": " << g[r * kSlots + s];
    TORCH_CHECK_VALUE(false, "cplib.", op, ": ranks disagree on ", field_name(sig, s), " (",
                      values.str(), "); every rank must make the same call (reported by the "
                      "consistency check, TORCH_DISTRIBUTED_DEBUG=DETAIL or "
                      "CPLIB_CHECK_CONSISTENCY=1)");
  }
}

}  // namespace cplib
