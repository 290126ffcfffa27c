// The cplib._C Python module: importing it loads every TORCH_LIBRARY
// registration in this shared object. Ops are defined in their own files.
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(cplib_c, m) {
  (void)m;
}

extern "C" {
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C", "cplib native ops", -1, nullptr,
                                   nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&def);
}
}
