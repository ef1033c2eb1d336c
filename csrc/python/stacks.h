/* stacks.h — Python stacks for the history (stacks.c): the calling thread's frames, interned
 * and named by an id that the core stores as a record's context (cp_history_set_context). */
#ifndef CPY_STACKS_H
#define CPY_STACKS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

/* The id of the calling thread's Python stack (1, 2, ...), or 0: capture is off, the thread
 * does not hold the GIL (it is not running Python: an autograd worker, say), or it has no
 * frame. Never blocks, never raises (an error inside is swallowed and gives 0). */
uint64_t cpy_stack_capture(void);

/* Module functions: set_history_stacks(on), history_stack(id), history_stack_count(). */
PyObject *cpy_mod_set_history_stacks(PyObject *module, PyObject *on);
PyObject *cpy_mod_history_stack(PyObject *module, PyObject *id);
PyObject *cpy_mod_history_stack_count(PyObject *module, PyObject *ignored);

#endif /* CPY_STACKS_H */
