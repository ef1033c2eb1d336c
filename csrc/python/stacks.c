/* stacks.c — Python stacks for the history: the frames of the thread that allocates or frees,
 * captured before the pool is entered and interned, so that a history record carries only an
 * id. Owns: the stack table (Note [Stack ids]). */
#include "python/stacks.h"

#include <stdatomic.h>
#include <string.h>

#include "devices/abi.h"

/* Note [Stack ids]
 * A capture walks the thread's frames (innermost first, at most CPY_STACK_DEPTH) and keys them
 * by the exact (code object, instruction offset) of each frame: no line numbers are computed
 * for a stack seen before, so a repeated call site costs one walk and one dict lookup. A new
 * stack gets the next id and its frames as (filename, line, name) tuples; its entry also
 * holds the code objects, so that their addresses (part of the key) cannot be reused by
 * others while the table lives. The table lives as long as the process: ids stay valid for
 * every record that names them. Everything here runs with the GIL held: a thread that does
 * not hold it (not running Python) records no stack, and nothing ever waits for the GIL, so
 * an allocation from a GIL-less thread can never deadlock against one that holds it. */

#define CPY_STACK_DEPTH 64

static atomic_int cpy_stacks_on;
static PyObject *cpy_stack_ids;   /* bytes key -> int id */
static PyObject *cpy_stack_table; /* list: [id - 1] = (frames, codes) */

typedef struct cpy_frame_key_s {
  uintptr_t code;
  intptr_t where; /* instruction offset (3.11+) or line */
} cpy_frame_key_t;

static int cpy_stack_tables(void) {
  if (cpy_stack_ids == NULL) cpy_stack_ids = PyDict_New();
  if (cpy_stack_table == NULL) cpy_stack_table = PyList_New(0);
  return cpy_stack_ids != NULL && cpy_stack_table != NULL ? 0 : -1;
}

/* Intern a new stack of `n` frames; its id, or 0 on error. */
static uint64_t cpy_stack_intern(PyObject *key, PyCodeObject **codes, const int *lines, int n) {
  PyObject *frames = PyTuple_New(n);
  PyObject *code_refs = PyTuple_New(n);
  PyObject *entry = NULL, *id = NULL;
  uint64_t result = 0;
  if (frames == NULL || code_refs == NULL) goto done;
  for (int i = 0; i < n; i++) {
    PyObject *co = (PyObject *)codes[i];
    PyObject *filename = PyObject_GetAttrString(co, "co_filename");
    PyObject *name = PyObject_GetAttrString(co, "co_name");
    PyObject *frame = filename != NULL && name != NULL ? Py_BuildValue("(OiO)", filename, lines[i], name) : NULL;
    Py_XDECREF(filename);
    Py_XDECREF(name);
    if (frame == NULL) goto done;
    PyTuple_SET_ITEM(frames, i, frame);
    Py_INCREF(co);
    PyTuple_SET_ITEM(code_refs, i, co);
  }
  entry = PyTuple_Pack(2, frames, code_refs);
  if (entry == NULL || PyList_Append(cpy_stack_table, entry) < 0) goto done;
  result = (uint64_t)PyList_GET_SIZE(cpy_stack_table);
  id = PyLong_FromUnsignedLongLong(result);
  if (id == NULL || PyDict_SetItem(cpy_stack_ids, key, id) < 0) result = 0;
done:
  Py_XDECREF(frames);
  Py_XDECREF(code_refs);
  Py_XDECREF(entry);
  Py_XDECREF(id);
  return result;
}

uint64_t cpy_stack_capture(void) {
  if (!atomic_load_explicit(&cpy_stacks_on, memory_order_relaxed) || !PyGILState_Check()) return 0;
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback); /* the caller's pending exception, if any, survives */
  cpy_frame_key_t keys[CPY_STACK_DEPTH];
  PyCodeObject *codes[CPY_STACK_DEPTH];
  int n = 0;
  PyFrameObject *f = PyEval_GetFrame(); /* borrowed */
  Py_XINCREF(f);
  while (f != NULL && n < CPY_STACK_DEPTH) {
    PyCodeObject *code = PyFrame_GetCode(f); /* new reference */
    codes[n] = code;
    keys[n].code = (uintptr_t)code;
#if PY_VERSION_HEX >= 0x030B0000
    keys[n].where = PyFrame_GetLasti(f);
#else
    keys[n].where = PyFrame_GetLineNumber(f);
#endif
    n++;
    PyFrameObject *back = PyFrame_GetBack(f); /* new reference */
    Py_DECREF(f);
    f = back;
  }
  Py_XDECREF(f);
  uint64_t id = 0;
  if (n > 0 && cpy_stack_tables() == 0) {
    PyObject *key = PyBytes_FromStringAndSize((const char *)keys, (Py_ssize_t)(sizeof keys[0] * (size_t)n));
    PyObject *known = key != NULL ? PyDict_GetItemWithError(cpy_stack_ids, key) : NULL; /* borrowed */
    if (known != NULL) {
      id = PyLong_AsUnsignedLongLong(known);
    } else if (key != NULL && !PyErr_Occurred()) {
      /* Lines are worked out only for a stack not seen before. */
      PyFrameObject *g = PyEval_GetFrame();
      Py_XINCREF(g);
      int lines[CPY_STACK_DEPTH];
      for (int i = 0; i < n && g != NULL; i++) {
        lines[i] = PyFrame_GetLineNumber(g);
        PyFrameObject *back = PyFrame_GetBack(g);
        Py_DECREF(g);
        g = back;
      }
      Py_XDECREF(g);
      id = cpy_stack_intern(key, codes, lines, n);
    }
    Py_XDECREF(key);
  }
  for (int i = 0; i < n; i++) Py_DECREF(codes[i]);
  if (PyErr_Occurred()) id = 0;
  PyErr_Restore(type, value, traceback);
  return id;
}

PyObject *cpy_mod_set_history_stacks(PyObject *Py_UNUSED(module), PyObject *on) {
  int flag = PyObject_IsTrue(on);
  if (flag < 0) return NULL;
  if (flag && cpy_stack_tables() < 0) return NULL;
  atomic_store_explicit(&cpy_stacks_on, flag, memory_order_relaxed);
  cpd_set_context_fn(flag ? cpy_stack_capture : NULL);
  Py_RETURN_NONE;
}

PyObject *cpy_mod_history_stack(PyObject *Py_UNUSED(module), PyObject *id_obj) {
  unsigned long long id = PyLong_AsUnsignedLongLong(id_obj);
  if (id == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
  if (id == 0 || cpy_stack_table == NULL || id > (unsigned long long)PyList_GET_SIZE(cpy_stack_table)) {
    Py_RETURN_NONE;
  }
  PyObject *entry = PyList_GET_ITEM(cpy_stack_table, (Py_ssize_t)(id - 1));
  PyObject *frames = PyTuple_GET_ITEM(entry, 0);
  Py_INCREF(frames);
  return frames;
}

PyObject *cpy_mod_history_stack_count(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored)) {
  return PyLong_FromSsize_t(cpy_stack_table != NULL ? PyList_GET_SIZE(cpy_stack_table) : 0);
}
