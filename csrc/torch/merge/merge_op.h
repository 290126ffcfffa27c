#pragma once

#include <ATen/ATen.h>

namespace cplib {

// Merges the block result (blk_out, blk_lse) into rows [row_offset, row_offset
// + rows) of the running (out, lse), in place, on the tensors' device.
void merge_partial(at::Tensor& out, at::Tensor& lse, const at::Tensor& blk_out,
                   const at::Tensor& blk_lse, int64_t row_offset);

}  // namespace cplib
