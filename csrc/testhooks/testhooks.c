/* testhooks.c — the module cudapool._testhooks: hooks tests use to steer the process-wide
 * device table of cudapool._C. Owns no state of its own beyond a view of _C's.
 *
 * Every call goes through the table _C lends in the capsule cudapool._C._hooks_api (Note [Test
 * hooks] in python/hooks_api.h): this module links no part of the core, so what it touches is
 * _C's device table and _C's last error. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

#include "python/hooks_api.h"

typedef struct hooks_state_s {
  const cpy_hooks_api *api; /* _C's table; _C stays imported (sys.modules) while we live */
  PyObject *c_module;       /* cudapool._C, held so its table and exception outlive us */
  PyObject *oom_error;      /* cudapool._C.OutOfMemoryError */
} hooks_state;

static hooks_state *get_state(PyObject *module) { return (hooks_state *)PyModule_GetState(module); }

/* The simulated device behind `device`'s pool; RuntimeError when there is none (not in sim
 * mode, or the device has not allocated yet). */
static cp_sim_t *existing_sim(const cpy_hooks_api *api, int device) {
  cp_sim_t *sim = api->device_sim(device);
  if (sim == NULL) {
    PyErr_Format(PyExc_RuntimeError, "device %d has no simulated device yet (use_sim_devices, then allocate)", device);
  }
  return sim;
}

/* existing_sim for the device a hook's argument names; NULL with an exception set. */
static cp_sim_t *sim_of(const cpy_hooks_api *api, PyObject *dev) {
  int d;
  if (api->parse_device(dev, &d) < 0) return NULL;
  return existing_sim(api, d);
}

/* A counter of the simulated device `dev` names, as a Python int. */
static PyObject *sim_count(PyObject *module, PyObject *dev, uint64_t (*count)(const cp_sim_t *sim)) {
  cp_sim_t *sim = sim_of(get_state(module)->api, dev);
  return sim == NULL ? NULL : PyLong_FromUnsignedLongLong((unsigned long long)count(sim));
}

/* None for CP_OK; else the status raised (with _C's last error as its message). */
static PyObject *none_or_raise(PyObject *module, int rc) {
  hooks_state *st = get_state(module);
  if (rc != CP_OK) return st->api->raise_status(st->oom_error, rc);
  Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------------------------
 * The hooks
 * ---------------------------------------------------------------------------------------- */

static PyObject *hook_alloc_catching(PyObject *module, PyObject *args) {
  const cpy_hooks_api *api = get_state(module)->api;
  PyObject *size_obj, *stream_obj;
  int device;
  if (!PyArg_ParseTuple(args, "OiO:alloc_catching", &size_obj, &device, &stream_obj)) return NULL;
  size_t size;
  uintptr_t stream;
  if (api->as_size(size_obj, "size", &size) < 0 || api->as_uintptr(stream_obj, "stream", &stream) < 0) return NULL;
  void *ptr = NULL;
  char msg[4096];
  msg[0] = '\0';
  int rc;
  Py_BEGIN_ALLOW_THREADS rc = api->alloc_catching(size, device, (void *)stream, &ptr, msg, sizeof msg);
  Py_END_ALLOW_THREADS return Py_BuildValue("(Kis)", (unsigned long long)(uintptr_t)ptr, rc, msg);
}

static PyObject *hook_sim_complete_all(PyObject *module, PyObject *dev) {
  const cpy_hooks_api *api = get_state(module)->api;
  int d;
  if (api->parse_device(dev, &d) < 0) return NULL;
  cp_sim_t *sim = api->device_sim(d);
  if (sim != NULL) api->sim_complete_all(sim);
  Py_RETURN_NONE;
}

static PyObject *hook_sim_delay_nth(PyObject *module, PyObject *args) {
  const cpy_hooks_api *api = get_state(module)->api;
  PyObject *dev, *n_obj, *ms_obj;
  const char *kind_name;
  if (!PyArg_ParseTuple(args, "OsOO:sim_delay_nth", &dev, &kind_name, &n_obj, &ms_obj)) return NULL;
  int d;
  cp_sim_call_t kind = CP_SIM_RESERVE;
  unsigned long long n, ms;
  if (api->parse_device(dev, &d) < 0 || api->parse_call_kind(kind_name, &kind) < 0) return NULL;
  if (api->as_unsigned(n_obj, "n", UINT64_MAX, &n) < 0 || api->as_unsigned(ms_obj, "ms", 60000, &ms) < 0) return NULL;
  cp_sim_t *sim = existing_sim(api, d);
  if (sim == NULL) return NULL;
  api->sim_delay_nth(sim, kind, (uint64_t)n, (unsigned)ms);
  Py_RETURN_NONE;
}

static PyObject *hook_sim_delays_entered(PyObject *module, PyObject *dev) {
  return sim_count(module, dev, get_state(module)->api->sim_delays_entered);
}

static PyObject *hook_sim_set_lost(PyObject *module, PyObject *args) {
  const cpy_hooks_api *api = get_state(module)->api;
  PyObject *dev;
  int lost = 1;
  if (!PyArg_ParseTuple(args, "O|p:sim_set_lost", &dev, &lost)) return NULL;
  cp_sim_t *sim = sim_of(api, dev);
  if (sim == NULL) return NULL;
  api->sim_set_lost(sim, lost);
  Py_RETURN_NONE;
}

static PyObject *hook_sim_invalidate_stream(PyObject *module, PyObject *args) {
  const cpy_hooks_api *api = get_state(module)->api;
  PyObject *dev, *stream_obj;
  if (!PyArg_ParseTuple(args, "OO:sim_invalidate_stream", &dev, &stream_obj)) return NULL;
  uintptr_t stream;
  cp_sim_t *sim = api->as_uintptr(stream_obj, "stream", &stream) < 0 ? NULL : sim_of(api, dev);
  if (sim == NULL) return NULL;
  api->clear_error();
  return none_or_raise(module, api->sim_invalidate_stream(sim, (cp_stream_t)stream));
}

static PyObject *hook_sim_set_capturing(PyObject *module, PyObject *args) {
  const cpy_hooks_api *api = get_state(module)->api;
  PyObject *dev, *stream_obj;
  int on = 1;
  if (!PyArg_ParseTuple(args, "OO|p:sim_set_capturing", &dev, &stream_obj, &on)) return NULL;
  uintptr_t stream;
  cp_sim_t *sim = api->as_uintptr(stream_obj, "stream", &stream) < 0 ? NULL : sim_of(api, dev);
  if (sim == NULL) return NULL;
  api->clear_error();
  return none_or_raise(module, api->sim_set_capturing(sim, (cp_stream_t)stream, on));
}

static PyObject *hook_sim_launch(PyObject *module, PyObject *args) {
  const cpy_hooks_api *api = get_state(module)->api;
  PyObject *dev, *stream_obj, *ptr_obj, *size_obj;
  if (!PyArg_ParseTuple(args, "OOOO:sim_launch", &dev, &stream_obj, &ptr_obj, &size_obj)) return NULL;
  uintptr_t stream, ptr, size;
  if (api->as_uintptr(stream_obj, "stream", &stream) < 0 || api->as_uintptr(ptr_obj, "ptr", &ptr) < 0 ||
      api->as_uintptr(size_obj, "size", &size) < 0)
    return NULL;
  cp_sim_t *sim = sim_of(api, dev);
  if (sim == NULL) return NULL;
  api->clear_error();
  return none_or_raise(module, api->sim_launch(sim, (cp_stream_t)stream, ptr, (size_t)size));
}

static PyObject *hook_sim_device_faults(PyObject *module, PyObject *dev) {
  return sim_count(module, dev, get_state(module)->api->sim_device_faults);
}

static PyObject *hook_sim_capture_violations(PyObject *module, PyObject *dev) {
  return sim_count(module, dev, get_state(module)->api->sim_capture_violations);
}

static PyObject *hook_sim_calls(PyObject *module, PyObject *args) {
  const cpy_hooks_api *api = get_state(module)->api;
  PyObject *dev;
  const char *kind_name;
  if (!PyArg_ParseTuple(args, "Os:sim_calls", &dev, &kind_name)) return NULL;
  int d;
  cp_sim_call_t kind = CP_SIM_RESERVE;
  if (api->parse_device(dev, &d) < 0 || api->parse_call_kind(kind_name, &kind) < 0) return NULL;
  cp_sim_t *sim = existing_sim(api, d);
  if (sim == NULL) return NULL;
  return PyLong_FromUnsignedLongLong((unsigned long long)api->sim_calls(sim, kind));
}

static PyObject *hook_failures_at_exit(PyObject *module, PyObject *Py_UNUSED(ignored)) {
  return PyLong_FromUnsignedLong(get_state(module)->api->failures_at_exit());
}

static PyObject *hook_fork_count(PyObject *module, PyObject *Py_UNUSED(ignored)) {
  return PyLong_FromUnsignedLong(get_state(module)->api->fork_count());
}

static PyMethodDef hooks_methods[] = {
    {"alloc_catching", hook_alloc_catching, METH_VARARGS,
     "alloc_catching(size, device, stream) -> (ptr, status, message)\n\nThe allocation entry "
     "point torch calls, with its exception caught."},
    {"sim_complete_all", hook_sim_complete_all, METH_O,
     "sim_complete_all(device)\n\nFinish all work of a simulated device (nothing without one)."},
    {"sim_delay_nth", hook_sim_delay_nth, METH_VARARGS,
     "sim_delay_nth(device, kind, n, ms)\n\nMake the n-th next backend call of kind on a simulated "
     "device sleep ms milliseconds with its locks held (n = 0 disarms)."},
    {"sim_delays_entered", hook_sim_delays_entered, METH_O,
     "sim_delays_entered(device) -> int\n\nHow many delays have started on the device."},
    {"sim_set_lost", hook_sim_set_lost, METH_VARARGS,
     "sim_set_lost(device, lost=True)\n\nEvery backend call of the simulated device fails from "
     "now on, as after the driver shut down."},
    {"sim_invalidate_stream", hook_sim_invalidate_stream, METH_VARARGS,
     "sim_invalidate_stream(device, stream)\n\nMake a stream of the simulated device invalid, as a "
     "destroyed one: recording an event on it fails from now on."},
    {"sim_set_capturing", hook_sim_set_capturing, METH_VARARGS,
     "sim_set_capturing(device, stream, on=True)\n\nPut a stream of the simulated device into graph capture "
     "(on=False ends it): event calls and releases are refused while any stream captures."},
    {"sim_launch", hook_sim_launch, METH_VARARGS,
     "sim_launch(device, stream, ptr, size)\n\nQueue work on a stream of a simulated device that uses "
     "[ptr, ptr + size)."},
    {"sim_device_faults", hook_sim_device_faults, METH_O,
     "sim_device_faults(device) -> int\n\nWhat the simulated device would have faulted on so far."},
    {"sim_capture_violations", hook_sim_capture_violations, METH_O,
     "sim_capture_violations(device) -> int\n\nCalls the simulated device refused because a stream was "
     "capturing (each would have broken a capture)."},
    {"sim_calls", hook_sim_calls, METH_VARARGS,
     "sim_calls(device, kind) -> int\n\nBackend calls of `kind` made so far on the simulated device."},
    {"failures_at_exit", hook_failures_at_exit, METH_NOARGS,
     "How many entry-point failures were counted silently since interpreter_exiting()."},
    {"fork_count", hook_fork_count, METH_NOARGS, "How many fork() calls cudapool's handlers saw."},
    {NULL, NULL, 0, NULL},
};

/* ------------------------------------------------------------------------------------------
 * Module definition (multi-phase init)
 * ---------------------------------------------------------------------------------------- */

static int hooks_exec(PyObject *module) {
  hooks_state *st = get_state(module);
  const cpy_hooks_api *api = (const cpy_hooks_api *)PyCapsule_Import(CPY_HOOKS_API_CAPSULE, 0);
  if (api == NULL) return -1;
  if (api->version != CPY_HOOKS_API_VERSION || api->size < sizeof(cpy_hooks_api)) {
    PyErr_Format(PyExc_ImportError, "cudapool._testhooks: cudapool._C lends hooks version %u (%zu bytes), not %d",
                 api->version, api->size, CPY_HOOKS_API_VERSION);
    return -1;
  }
  st->api = api;
  st->c_module = PyImport_ImportModule("cudapool._C");
  if (st->c_module == NULL) return -1;
  st->oom_error = PyObject_GetAttrString(st->c_module, "OutOfMemoryError");
  if (st->oom_error == NULL) return -1;
  return 0;
}

static int hooks_traverse(PyObject *module, visitproc visit, void *arg) {
  hooks_state *st = get_state(module);
  if (st == NULL) return 0;
  Py_VISIT(st->c_module);
  Py_VISIT(st->oom_error);
  return 0;
}

static int hooks_clear(PyObject *module) {
  hooks_state *st = get_state(module);
  if (st == NULL) return 0;
  Py_CLEAR(st->c_module);
  Py_CLEAR(st->oom_error);
  return 0;
}

static void hooks_free(void *module) { (void)hooks_clear((PyObject *)module); }

static PyModuleDef_Slot hooks_slots[] = {
    {Py_mod_exec, (void *)hooks_exec},
    {0, NULL},
};

PyDoc_STRVAR(hooks_doc,
             "cudapool._testhooks — hooks for tests: fault injection on the simulated devices of "
             "cudapool._C's device table, the allocation entry point with its exception caught, and "
             "the fork and exit counters. Not for production use.");

static struct PyModuleDef hooks_def = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "cudapool._testhooks",
    .m_doc = hooks_doc,
    .m_size = sizeof(hooks_state),
    .m_methods = hooks_methods,
    .m_slots = hooks_slots,
    .m_traverse = hooks_traverse,
    .m_clear = hooks_clear,
    .m_free = hooks_free,
};

PyMODINIT_FUNC PyInit__testhooks(void);

PyMODINIT_FUNC PyInit__testhooks(void) { return PyModuleDef_Init(&hooks_def); }
