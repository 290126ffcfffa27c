#include "flex/flex_aten.h"

namespace cplib::flex {

Tensor movedim(const Tensor& x, int64_t source, int64_t destination) {
  return ret<Tensor>(call("aten::movedim", "int", x, source, destination)[0]);
}

}  // namespace cplib::flex
