#pragma once

#include "common/stable.h"

namespace cplib {

// Merges the block result (blk_out, blk_lse) into rows [row_offset, row_offset
// + rows) of the running (out, lse), in place, on the tensors' device.
void merge_partial(Tensor& out, Tensor& lse, const Tensor& blk_out, const Tensor& blk_lse,
                   int64_t row_offset);

}  // namespace cplib
