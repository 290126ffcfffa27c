// The ATen op the flex all-gather needs that torch's stable ops header lacks.
#pragma once

#include "common/stable.h"

namespace cplib::flex {

Tensor movedim(const Tensor& x, int64_t source, int64_t destination);

}  // namespace cplib::flex
