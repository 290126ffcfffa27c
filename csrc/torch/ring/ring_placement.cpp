#include "ring/ring_placement.h"

#include <algorithm>
#include <utility>

#include "common/c_core.h"
#include "common/errors.h"
#include "common/stable.h"
#include "cplib/placement.h"

namespace cplib::ring {
namespace {

struct Entry {
  std::vector<int64_t> bounds;
  int64_t ranks;
  std::shared_ptr<const Placement> placement;
};

// Most recently used first; a batch's layers hit the front entry.
constexpr size_t kCached = 4;
thread_local std::vector<Entry> t_cache;

std::shared_ptr<const Placement> compute(const std::vector<int64_t>& bounds, int64_t ranks) {
  const int64_t docs = static_cast<int64_t>(bounds.size()) - 1;
  std::vector<cplib_placed_piece> pieces(
      static_cast<size_t>(cplib_placement_max_pieces(docs, ranks)));
  int64_t count = 0;
  check_status(cplib_document_placement(bounds.data(), docs, ranks, pieces.data(), &count),
               "document placement");
  auto placement = std::make_shared<Placement>(static_cast<size_t>(ranks));
  for (int64_t i = 0; i < count; ++i) {
    const cplib_placed_piece& p = pieces[static_cast<size_t>(i)];
    (*placement)[static_cast<size_t>(p.rank)].push_back({p.start, p.len});
  }
  return placement;
}

}  // namespace

std::shared_ptr<const Placement> document_placement(const std::vector<int64_t>& bounds,
                                                    int64_t ranks) {
  auto hit = std::find_if(t_cache.begin(), t_cache.end(),
                          [&](const Entry& e) { return e.ranks == ranks && e.bounds == bounds; });
  if (hit != t_cache.end()) {
    std::rotate(t_cache.begin(), hit, hit + 1);
    return t_cache.front().placement;
  }
  Entry e{bounds, ranks, compute(bounds, ranks)};
  t_cache.insert(t_cache.begin(), std::move(e));
  if (t_cache.size() > kCached) t_cache.pop_back();
  return t_cache.front().placement;
}

std::vector<int64_t> flatten(const Placement& placement) {
  std::vector<int64_t> flat;
  for (size_t r = 0; r < placement.size(); ++r)
    for (const Range& g : placement[r])
      flat.insert(flat.end(), {static_cast<int64_t>(r), g.start, g.len});
  return flat;
}

namespace {

// cplib_c::document_placement: the pieces for cplib.DocumentPlacementLoadBalancer.
std::vector<int64_t> document_placement_op(std::vector<int64_t> cu_seqlens, int64_t world_size) {
  CPLIB_CHECK_VALUE(world_size >= 1, "cplib.document_placement: world_size must be >= 1, got ",
                    world_size);
  CPLIB_CHECK_VALUE(cu_seqlens.size() >= 2 && cu_seqlens.front() == 0,
                    "cplib.document_placement: "
                    "cu_seqlens must be [0, ..., S] with at least 2 entries");
  for (size_t i = 1; i < cu_seqlens.size(); ++i)
    CPLIB_CHECK_VALUE(cu_seqlens[i] > cu_seqlens[i - 1],
                      "cplib.document_placement: cu_seqlens "
                      "must be strictly increasing, got ",
                      cu_seqlens[i - 1], " then ", cu_seqlens[i], " at index ", i);
  CPLIB_CHECK_VALUE(cu_seqlens.back() >= world_size,
                    "cplib.document_placement: the sequence "
                    "length ",
                    cu_seqlens.back(), " is shorter than the world size ", world_size,
                    " (every rank needs a token)");
  return flatten(*document_placement(cu_seqlens, world_size));
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(cplib_c, m) {
  m.def("document_placement(int[] cu_seqlens, int world_size) -> int[]");
}

// No tensor arguments: CompositeExplicitAutograd.
STABLE_TORCH_LIBRARY_IMPL(cplib_c, CompositeExplicitAutograd, m) {
  m.impl("document_placement", CPLIB_BOX(&document_placement_op));
}

}  // namespace cplib::ring
