/* module.h — what the files of the binding (module cudapool._C) share: the module state, the
 * module definition, and the pool-handle type's spec and constructor. */
#ifndef CPY_MODULE_H
#define CPY_MODULE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* The per-module state of cudapool._C. */
typedef struct cpy_state_s {
  PyObject *oom_error;     /* cudapool._C.OutOfMemoryError, a MemoryError */
  PyTypeObject *pool_type; /* cudapool._C.Pool */
} cpy_state;

extern struct PyModuleDef cpy_module_def;

/* The state of the module `module` (cudapool._C). */
cpy_state *cpy_state_of_module(PyObject *module);

/* The state of the module that defined `type` or the nearest of its bases defined by
 * cudapool._C (Pool may be subclassed in Python: Note [Subclassing Pool] in pool.c).
 * NULL with TypeError set when there is none. */
cpy_state *cpy_state_of_type(PyTypeObject *type);

/* The pool-handle type, cudapool._C.Pool (pool.c). */
extern PyType_Spec cpy_pool_spec;
/* Make cpy_pool_spec's method table (pool.c); before the type is made. -1 with an exception. */
int cpy_pool_spec_prepare(void);

/* {pool block state: torch's block state, or None where torch shows no memory} (Note [Torch's
 * segments] in core/cp.h): the module's TORCH_BLOCK_STATES (pool.c). */
PyObject *cpy_pool_torch_block_states(void);

/* A new Pool handle naming device `device` (0 <= device < CP_MAX_DEVICES) of the
 * process-wide table. */
PyObject *cpy_pool_for_device(cpy_state *st, int device);

/* A PyCFunction for a METH_VARARGS | METH_KEYWORDS implementation. */
#define CPY_METH_KW(fn) ((PyCFunction)(void (*)(void))(fn))

#endif /* CPY_MODULE_H */
