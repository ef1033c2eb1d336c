/* state.h — what every file of the binding (module cudapool._C) shares: the module state, the
 * way from a module or a type to it, and the cast of a keyword method. The floor of csrc/python:
 * module.c, above all its files, defines the module. */
#ifndef CPY_STATE_H
#define CPY_STATE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* The per-module state of cudapool._C. */
typedef struct cpy_state_s {
  PyObject *oom_error;     /* cudapool._C.OutOfMemoryError, a MemoryError */
  PyTypeObject *pool_type; /* cudapool._C.Pool */
} cpy_state;

/* The module's definition (module.c). */
extern struct PyModuleDef cpy_module_def;

/* The state of the module `module` (cudapool._C). */
cpy_state *cpy_state_of_module(PyObject *module);

/* The state of the module that defined `type` or the nearest of its bases defined by
 * cudapool._C (Pool may be subclassed in Python: Note [Subclassing Pool] in pool.c).
 * NULL with TypeError set when there is none. */
cpy_state *cpy_state_of_type(PyTypeObject *type);

/* A PyCFunction for a METH_VARARGS | METH_KEYWORDS implementation. */
#define CPY_METH_KW(fn) ((PyCFunction)(void (*)(void))(fn))

#endif /* CPY_STATE_H */
