/* state.c — the module state of cudapool._C (state.h): from a module, or from a type it
 * defined, to its state. */
#include "python/state.h"

cpy_state *cpy_state_of_module(PyObject *module) { return (cpy_state *)PyModule_GetState(module); }

cpy_state *cpy_state_of_type(PyTypeObject *type) {
#if PY_VERSION_HEX >= 0x030B0000
  PyObject *module = PyType_GetModuleByDef(type, &cpy_module_def);
  return module != NULL ? cpy_state_of_module(module) : NULL;
#else
  for (PyTypeObject *t = type; t != NULL; t = t->tp_base) {
    if (!(t->tp_flags & Py_TPFLAGS_HEAPTYPE)) continue;
    PyObject *module = ((PyHeapTypeObject *)t)->ht_module;
    if (module != NULL && PyModule_GetDef(module) == &cpy_module_def) return cpy_state_of_module(module);
  }
  PyErr_Format(PyExc_TypeError, "%s is not a cudapool._C type", type->tp_name);
  return NULL;
#endif
}
