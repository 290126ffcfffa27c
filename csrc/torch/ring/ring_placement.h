// The document placement layout (csrc/include/cplib/placement.h): every
// rank's pieces of a packed sequence, computed once per set of documents and
// world size and shared by the ring (ring_layout.h) and, through the op
// cplib_c::document_placement, by cplib.DocumentPlacementLoadBalancer: one
// implementation, so the shards and the ring never disagree.
#pragma once

#include <memory>
#include <vector>

#include "ring/ring_layout.h"

// Internal to the extension (torch's stable types are hidden).
#pragma GCC visibility push(hidden)

namespace cplib::ring {

// Every rank's pieces (global ranges, in local order).
using Placement = std::vector<std::vector<Range>>;

// The placement of the documents `bounds` (cu_seqlens, checked) over `ranks`
// ranks. Cached per thread on the values (a few entries): the layers of one
// batch share one computation.
std::shared_ptr<const Placement> document_placement(const std::vector<int64_t>& bounds,
                                                    int64_t ranks);

// The placement flattened to [rank, start, len] triples, rank-major (the
// handshake hashes it; the op returns it).
std::vector<int64_t> flatten(const Placement& placement);

}  // namespace cplib::ring

#pragma GCC visibility pop
