// The cplib._C Python module: importing it loads every op registration in
// this shared object (ops are defined in their own files). Python's limited
// API only: one binary serves every Python from the one it targets.
#include <Python.h>

#include "common/stable.h"

STABLE_TORCH_LIBRARY(cplib_c, m) { (void)m; }

extern "C" {
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef def = {PyModuleDef_HEAD_INIT,
                                   "_C",
                                   "cplib native ops",
                                   -1,
                                   nullptr,
                                   nullptr,
                                   nullptr,
                                   nullptr,
                                   nullptr};
  return PyModule_Create(&def);
}
}
