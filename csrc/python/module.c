/* module.c — the module cudapool._C: its functions and its definition (its state: state.c).
 * Owns: configuration parsing, the process-wide device table's Python face, module init. */
#include "python/state.h"

#include <stdio.h>
#include <string.h>

#include "backend/cuda.h"
#include "backend/sim.h"
#include "base/fork.h"
#include "core/cp.h"
#include "devices/abi.h"
#include "devices/devices.h"
#include "devices/graphs.h"
#include "python/convert.h"
#include "python/hooks_api.h"
#include "python/pool.h"
#include "python/stacks.h"

/* ------------------------------------------------------------------------------------------
 * Adding to the module
 * ---------------------------------------------------------------------------------------- */

static int module_add_ref(PyObject *module, const char *name, PyObject *value) {
#if PY_VERSION_HEX >= 0x030A0000
  return PyModule_AddObjectRef(module, name, value);
#else
  Py_INCREF(value);
  if (PyModule_AddObject(module, name, value) < 0) {
    Py_DECREF(value);
    return -1;
  }
  return 0;
#endif
}

/* Steals `value` (which may be NULL after a failed constructor). */
static int module_add_new(PyObject *module, const char *name, PyObject *value) {
  if (value == NULL) return -1;
  int rc = module_add_ref(module, name, value);
  Py_DECREF(value);
  return rc;
}

/* ------------------------------------------------------------------------------------------
 * Configuration
 * ---------------------------------------------------------------------------------------- */

static PyObject *mod_parse_config(PyObject *Py_UNUSED(module), PyObject *args) {
  const char *text;
  if (!PyArg_ParseTuple(args, "s:parse_config", &text)) return NULL;
  cp_config_t cfg;
  cp_config_default(&cfg);
  cp_clear_error();
  int rc = cp_config_parse(&cfg, text);
  if (rc != CP_OK) {
    const char *msg = cp_last_error();
    if (rc == CP_ERR_HOST_OOM) return PyErr_NoMemory();
    PyErr_SetString(PyExc_ValueError, msg[0] != '\0' ? msg : cp_status_name(rc));
    return NULL;
  }
  return cpy_config_to_str(&cfg);
}

/* ------------------------------------------------------------------------------------------
 * The process-wide device pools (the ones torch allocates from)
 * ---------------------------------------------------------------------------------------- */

static PyObject *mod_configure(PyObject *module, PyObject *args) {
  const char *text;
  if (!PyArg_ParseTuple(args, "s:configure", &text)) return NULL;
  cp_config_t cfg;
  cp_config_default(&cfg);
  cp_clear_error();
  int rc = cp_config_parse(&cfg, text);
  if (rc == CP_OK) rc = cpd_configure(&cfg);
  if (rc == CP_ERR_STATE) {
    PyErr_SetString(PyExc_RuntimeError, cp_last_error());
    return NULL;
  }
  if (rc != CP_OK) return cpy_raise_status(cpy_state_of_module(module)->oom_error, rc);
  return cpy_config_to_str(&cfg);
}

static PyObject *mod_device_config(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored)) {
  cp_config_t cfg;
  cpd_config(&cfg);
  return cpy_config_to_str(&cfg);
}

static PyObject *mod_use_sim_devices(PyObject *module, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"capacity", "count", "touch_memory", "auto_complete", NULL};
  PyObject *cap_obj;
  int count = 1, touch = 1, auto_complete = 1;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|ipp:use_sim_devices", kwlist, &cap_obj, &count, &touch,
                                   &auto_complete)) {
    return NULL;
  }
  size_t capacity;
  if (cpy_as_size(cap_obj, "capacity", &capacity) < 0) return NULL;
  unsigned flags = (touch ? 0u : CP_SIM_NO_TOUCH) | (auto_complete ? CP_SIM_AUTO_COMPLETE : 0u);
  cp_clear_error();
  int rc = cpd_use_sim(capacity, count, flags);
  if (rc == CP_ERR_STATE) {
    PyErr_SetString(PyExc_RuntimeError, cp_last_error());
    return NULL;
  }
  if (rc != CP_OK) return cpy_raise_status(cpy_state_of_module(module)->oom_error, rc);
  Py_RETURN_NONE;
}

static PyObject *mod_using_sim_devices(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored)) {
  return PyBool_FromLong(cpd_using_sim());
}

static PyObject *mod_device_pools(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored)) {
  PyObject *list = PyList_New(0);
  if (list == NULL) return NULL;
  for (int d = 0; d < CP_MAX_DEVICES; d++) {
    if (cpd_pool_if_created(d) == NULL) continue;
    PyObject *v = PyLong_FromLong(d);
    if (v == NULL || PyList_Append(list, v) < 0) {
      Py_XDECREF(v);
      Py_DECREF(list);
      return NULL;
    }
    Py_DECREF(v);
  }
  return list;
}

/* A Pool handle of a device (Note [Pool handles] in pool.c); creates no pool. */
static PyObject *mod_device_pool(PyObject *module, PyObject *dev) {
  int d;
  if (cpy_parse_device(dev, &d) < 0) return NULL;
  return cpy_pool_for_device(cpy_state_of_module(module), d);
}

static PyObject *mod_set_device_history(PyObject *Py_UNUSED(module), PyObject *entries_obj) {
  size_t entries;
  if (cpy_as_size(entries_obj, "max_entries", &entries) < 0) return NULL;
  cp_clear_error();
  int rc = cpd_set_history(entries);
  if (rc == CP_ERR_HOST_OOM) return PyErr_NoMemory();
  if (rc != CP_OK) {
    PyErr_SetString(PyExc_ValueError, cp_last_error());
    return NULL;
  }
  Py_RETURN_NONE;
}

static PyObject *mod_device_history_entries(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored)) {
  return cpy_from_size(cpd_history_entries());
}

static PyObject *mod_interpreter_exiting(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored)) {
  cpd_set_exiting();
  Py_RETURN_NONE;
}

static PyObject *mod_memory_fraction(PyObject *Py_UNUSED(module), PyObject *dev) {
  int device;
  if (cpy_parse_device(dev, &device) < 0) return NULL;
  return PyFloat_FromDouble(cpd_memory_fraction(device));
}

static PyObject *mod_foreign_pointer_calls(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored)) {
  unsigned long long frees, record_streams;
  cpd_foreign_calls(&frees, &record_streams);
  return Py_BuildValue("{sKsK}", "free", frees, "record_stream", record_streams);
}

static PyObject *mod_set_event_log(PyObject *module, PyObject *n_obj) {
  size_t n;
  if (cpy_as_size(n_obj, "capacity", &n) < 0) return NULL;
  cp_clear_error();
  int rc = cpd_set_event_log(n);
  if (rc != CP_OK) return cpy_raise_status(cpy_state_of_module(module)->oom_error, rc);
  Py_RETURN_NONE;
}

static PyObject *mod_event_log_capacity(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored)) {
  return cpy_from_size(cpd_event_log());
}

/* The private pools of CUDA graphs and MemPool ids (Note [Graph pools]): a list of dicts. */
static PyObject *mod_graph_pools(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored)) {
  cpd_graph_info_t infos[64];
  size_t n;
  Py_BEGIN_ALLOW_THREADS n = cpd_graph_pools(infos, 64);
  Py_END_ALLOW_THREADS if (n > 64) n = 64;
  PyObject *list = PyList_New(0);
  for (size_t i = 0; list != NULL && i < n; i++) {
    const cpd_graph_info_t *g = &infos[i];
    PyObject *d =
        Py_BuildValue("{sis(KK)sIsOsnsnsnszsn}", "device", g->device, "id", g->id0, g->id1, "uses", g->uses,
                      "window_open", g->window_open ? Py_True : Py_False, "allocated", (Py_ssize_t)g->allocated,
                      "reserved", (Py_ssize_t)g->reserved, "allocations", (Py_ssize_t)g->allocations, "region",
                      g->tag != 0 ? cp_region_name(g->tag) : NULL, "paused", (Py_ssize_t)g->paused);
    if (d == NULL || PyList_Append(list, d) < 0) Py_CLEAR(list);
    Py_XDECREF(d);
  }
  return list;
}

/* graph_pause(device, tag_id, backup) and graph_resume(device, tag_id): Note [Graph regions]. */
static PyObject *mod_graph_pause(PyObject *module, PyObject *args) {
  int device = 0, backup = 0;
  unsigned int tag = 0;
  if (!PyArg_ParseTuple(args, "iIp:graph_pause", &device, &tag, &backup)) return NULL;
  int rc;
  cp_clear_error();
  Py_BEGIN_ALLOW_THREADS rc = cpd_graph_pause(device, tag, backup);
  Py_END_ALLOW_THREADS if (rc != CP_OK) return cpy_raise_status(cpy_state_of_module(module)->oom_error, rc);
  Py_RETURN_NONE;
}

static PyObject *mod_graph_resume(PyObject *module, PyObject *args) {
  int device = 0;
  unsigned int tag = 0;
  if (!PyArg_ParseTuple(args, "iI:graph_resume", &device, &tag)) return NULL;
  int rc;
  cp_clear_error();
  Py_BEGIN_ALLOW_THREADS rc = cpd_graph_resume(device, tag);
  Py_END_ALLOW_THREADS if (rc != CP_OK) return cpy_raise_status(cpy_state_of_module(module)->oom_error, rc);
  Py_RETURN_NONE;
}

static PyObject *mod_shutdown(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored)) {
  Py_BEGIN_ALLOW_THREADS cpd_shutdown();
  Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

/* What the CUDA driver says, without raising: {"available", "error", "driver_version",
 * "device_count", "devices": [names], "page_mapped": [(supported, why not) per device]}. */
static PyObject *mod_cuda_info(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored)) {
  int rc, version = 0, count = 0;
  Py_BEGIN_ALLOW_THREADS;
  rc = cp_cuda_load();
  if (rc == CP_OK) rc = cp_cuda_driver_version(&version);
  if (rc == CP_OK) rc = cp_cuda_device_count(&count);
  Py_END_ALLOW_THREADS;
  char error[512] = "";
  if (rc != CP_OK) snprintf(error, sizeof error, "%s", cp_last_error());
  PyObject *names = PyList_New(0);
  PyObject *vmm = PyList_New(0);
  if (names == NULL || vmm == NULL) {
    Py_XDECREF(names);
    Py_XDECREF(vmm);
    return NULL;
  }
  for (int d = 0; rc == CP_OK && d < count; d++) {
    char name[256] = "";
    if (cp_cuda_device_name(d, name, sizeof name) != CP_OK) snprintf(name, sizeof name, "?");
    /* Whether the device's pool can use page-mapped memory, and why not. */
    int supported = 0;
    char why[256] = "";
    if (cp_cuda_vmm_support(d, &supported, why, sizeof why) != CP_OK) snprintf(why, sizeof why, "%s", cp_last_error());
    PyObject *n = PyUnicode_FromString(name);
    PyObject *v = Py_BuildValue("(Os)", supported ? Py_True : Py_False, why);
    int failed = n == NULL || v == NULL || PyList_Append(names, n) < 0 || PyList_Append(vmm, v) < 0;
    Py_XDECREF(n);
    Py_XDECREF(v);
    if (failed) {
      Py_DECREF(names);
      Py_DECREF(vmm);
      return NULL;
    }
  }
  return Py_BuildValue("{s:O,s:s,s:i,s:i,s:N,s:N}", "available", rc == CP_OK && count > 0 ? Py_True : Py_False, "error",
                       error, "driver_version", version, "device_count", count, "devices", names, "page_mapped", vmm);
}

/* Regions (core/region.c): the id of a name, the thread's region. */
static PyObject *mod_region_id(PyObject *Py_UNUSED(m), PyObject *name) {
  const char *text = PyUnicode_Check(name) ? PyUnicode_AsUTF8(name) : NULL;
  if (text == NULL) {
    if (!PyErr_Occurred()) PyErr_Format(PyExc_TypeError, "a region's tag is a str, not %s", Py_TYPE(name)->tp_name);
    return NULL;
  }
  uint32_t id = 0;
  if (cp_region_id(text, &id) != CP_OK) {
    PyErr_SetString(PyExc_ValueError, cp_last_error());
    return NULL;
  }
  return PyLong_FromUnsignedLong(id);
}

static PyObject *mod_region_enter(PyObject *Py_UNUSED(m), PyObject *arg) {
  const unsigned long id = PyLong_AsUnsignedLong(arg);
  if (id == (unsigned long)-1 && PyErr_Occurred()) return NULL;
  if (id != 0 && cp_region_name((uint32_t)id) == NULL) {
    PyErr_Format(PyExc_ValueError, "no region has id %lu", id);
    return NULL;
  }
  return PyLong_FromUnsignedLong(cp_region_enter((uint32_t)id));
}

static PyObject *mod_region_name(PyObject *Py_UNUSED(m), PyObject *arg) {
  const unsigned long id = PyLong_AsUnsignedLong(arg);
  if (id == (unsigned long)-1 && PyErr_Occurred()) return NULL;
  const char *name = id <= UINT32_MAX ? cp_region_name((uint32_t)id) : NULL;
  if (name == NULL) Py_RETURN_NONE;
  return PyUnicode_FromString(name);
}

static PyObject *mod_region_of_thread(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(ignored)) {
  return PyLong_FromUnsignedLong(cp_region_of_thread());
}

static PyMethodDef module_methods[] = {
    {"region_id", mod_region_id, METH_O,
     "region_id(name) -> int\n\nThe id of region name (made on first use; the same on every device)."},
    {"region_enter", mod_region_enter, METH_O,
     "region_enter(id) -> int\n\nMake region id (0: none) the calling thread's; returns the one it was in."},
    {"region_name", mod_region_name, METH_O, "region_name(id) -> str or None\n\nThe name of region id."},
    {"region_of_thread", mod_region_of_thread, METH_NOARGS, "The calling thread's region id (0: none)."},
    {"parse_config", mod_parse_config, METH_VARARGS,
     "parse_config(text) -> str\n\nParse a PYTORCH_CUDA_ALLOC_CONF-style string onto the "
     "defaults and return the resulting configuration, formatted. ValueError if invalid."},
    {"configure", mod_configure, METH_VARARGS,
     "configure(text) -> str\n\nSet the configuration of the device pools (defaults + text). "
     "RuntimeError once a device pool exists; ValueError for a bad key or value."},
    {"device_config", mod_device_config, METH_NOARGS, "The device pools' configuration, formatted."},
    {"use_sim_devices", CPY_METH_KW(mod_use_sim_devices), METH_VARARGS | METH_KEYWORDS,
     "use_sim_devices(capacity, count=1, touch_memory=True, auto_complete=True)\n\n"
     "Serve the device pools from simulated devices (before any pool exists)."},
    {"using_sim_devices", mod_using_sim_devices, METH_NOARGS, "True when devices are simulated."},
    {"device_pools", mod_device_pools, METH_NOARGS, "The devices whose pool exists."},
    {"device_pool", mod_device_pool, METH_O,
     "device_pool(device) -> Pool\n\nA handle of the device's process-wide pool: statistics, info, "
     "checks, reports, resets, empty_cache and set_memory_fraction. Creates no pool; looks the pool "
     "up on every call, so it stays valid across shutdown()."},
    {"set_device_history", mod_set_device_history, METH_O,
     "set_device_history(max_entries)\n\nRecord the history of every device pool, now and created later, in a ring "
     "of max_entries records (0: off)."},
    {"device_history_entries", mod_device_history_entries, METH_NOARGS, "The device pools' history ring size."},
    {"set_history_stacks", cpy_mod_set_history_stacks, METH_O,
     "set_history_stacks(on)\n\nCapture the Python stack of each allocation and free (of threads running Python) "
     "as the history's stack ids."},
    {"history_stack", cpy_mod_history_stack, METH_O,
     "history_stack(id) -> tuple or None\n\nThe frames of a stack id, innermost first: (filename, line, name)."},
    {"history_stack_count", cpy_mod_history_stack_count, METH_NOARGS, "Distinct stacks captured so far."},
    {"interpreter_exiting", mod_interpreter_exiting, METH_NOARGS,
     "Called at interpreter exit: from now on failed frees are counted, not printed."},
    {"memory_fraction", mod_memory_fraction, METH_O,
     "memory_fraction(device) -> float\n\nThe device's memory fraction as torch's "
     "get_per_process_memory_fraction reports it: the last one set_per_process_memory_fraction set "
     "(0.0 included), else the configuration's memory_fraction, else 1.0."},
    {"foreign_pointer_calls", mod_foreign_pointer_calls, METH_NOARGS,
     "foreign_pointer_calls() -> dict\n\nHow many frees and record_streams torch made on pointers that no "
     "pool holds (memory of another allocator, a DLPack import): they do nothing and print nothing."},
    {"set_event_log", mod_set_event_log, METH_O,
     "set_event_log(capacity)\n\nEvents each device pool keeps in its event log, the history an out-of-memory "
     "failure is replayed from (existing pools drop theirs; 0: none). Back to the default at shutdown()."},
    {"event_log_capacity", mod_event_log_capacity, METH_NOARGS, "The device pools' event log capacity setting."},
    {"graph_pools", mod_graph_pools, METH_NOARGS,
     "graph_pools() -> list\n\nThe private pools of CUDA graphs and MemPool ids, oldest first (at most 64): "
     "device, id, uses (begins not released), window_open, allocated, reserved, allocations."},
    {"graph_pause", mod_graph_pause, METH_VARARGS,
     "graph_pause(device, tag_id, backup)\n\nPause the CUDA graph pools of region tag_id (0: every region) on "
     "device: every mapped byte of them."},
    {"graph_resume", mod_graph_resume, METH_VARARGS,
     "graph_resume(device, tag_id)\n\nResume the CUDA graph pools of region tag_id (0: every region) on device."},
    {"shutdown", mod_shutdown, METH_NOARGS,
     "Destroy every device pool (all memory goes back); later use creates fresh ones."},
    {"cuda_info", mod_cuda_info, METH_NOARGS, "What the CUDA driver says (never raises)."},
    {NULL, NULL, 0, NULL},
};

/* ------------------------------------------------------------------------------------------
 * The test hooks' table (Note [Test hooks] in hooks_api.h)
 * ---------------------------------------------------------------------------------------- */

static const cpy_hooks_api hooks_api = {
    .version = CPY_HOOKS_API_VERSION,
    .size = sizeof(cpy_hooks_api),
    .raise_status = cpy_raise_status,
    .as_unsigned = cpy_as_unsigned,
    .as_size = cpy_as_size,
    .as_uintptr = cpy_as_uintptr,
    .parse_device = cpy_parse_device,
    .parse_call_kind = cpy_parse_call_kind,
    .clear_error = cp_clear_error,
    .device_sim = cpd_sim,
    .failures_at_exit = cpd_failures_at_exit,
    .alloc_catching = cudapool_alloc_catching,
    .fork_count = cp_fork_count,
    .sim_complete_all = cp_sim_complete_all,
    .sim_delay_nth = cp_sim_delay_nth,
    .sim_delays_entered = cp_sim_delays_entered,
    .sim_set_lost = cp_sim_set_lost,
    .sim_invalidate_stream = cp_sim_invalidate_stream,
    .sim_set_capturing = cp_sim_set_capturing,
    .sim_capture_violations = cp_sim_capture_violations,
    .sim_calls = cp_sim_calls,
    .sim_launch = cp_sim_launch,
    .sim_device_faults = cp_sim_device_faults,
};

/* ------------------------------------------------------------------------------------------
 * Module definition (multi-phase init)
 * ---------------------------------------------------------------------------------------- */

static int module_exec(PyObject *module) {
  cpy_state *st = cpy_state_of_module(module);
  if (st == NULL) return -1;

  st->oom_error = PyErr_NewExceptionWithDoc("cudapool._C.OutOfMemoryError",
                                            "The pool could not get device memory (or hit its memory cap).",
                                            PyExc_MemoryError, NULL);
  if (st->oom_error == NULL) return -1;
  if (module_add_ref(module, "OutOfMemoryError", st->oom_error) < 0) return -1;

  if (cpy_pool_spec_prepare() < 0) return -1;
  st->pool_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &cpy_pool_spec, NULL);
  if (st->pool_type == NULL) return -1;
  if (PyModule_AddType(module, st->pool_type) < 0) return -1;

  /* The table is const; the capsule API wants a plain pointer, and users only read it. */
  if (module_add_new(module, "_hooks_api", PyCapsule_New((void *)&hooks_api, CPY_HOOKS_API_CAPSULE, NULL)) < 0) {
    return -1;
  }

  if (PyModule_AddStringConstant(module, "__version__", CP_VERSION) < 0) return -1;
  if (module_add_new(module, "STAT_FAMILIES", cpy_str_tuple(cp_stat_family_names, CP_STAT_FAMILY_COUNT)) < 0) {
    return -1;
  }
  if (module_add_new(module, "TORCH_BLOCK_STATES", cpy_pool_torch_block_states()) < 0) return -1;
  if (module_add_new(module, "POOL_KINDS", cpy_str_tuple(cp_pool_kind_names, CP_KIND_COUNT)) < 0) return -1;
  if (module_add_new(module, "STAT_METRICS", cpy_str_tuple(cpy_stat_metric_names, 4)) < 0) return -1;

  static const char *const counter_names[] = {
#define CP_X(name) #name,
      CP_STAT_COUNTERS(CP_X)
#undef CP_X
  };
  const size_t counter_count = sizeof counter_names / sizeof counter_names[0];
  if (module_add_new(module, "STAT_COUNTERS", cpy_str_tuple(counter_names, counter_count)) < 0) return -1;

  const char *sim_calls[CP_SIM_CALL_COUNT];
  for (int i = 0; i < (int)CP_SIM_CALL_COUNT; i++) sim_calls[i] = cp_sim_call_name((cp_sim_call_t)i);
  if (module_add_new(module, "SIM_CALLS", cpy_str_tuple(sim_calls, CP_SIM_CALL_COUNT)) < 0) return -1;
  return 0;
}

static int module_traverse(PyObject *module, visitproc visit, void *arg) {
  cpy_state *st = cpy_state_of_module(module);
  if (st == NULL) return 0;
  Py_VISIT(st->oom_error);
  Py_VISIT(st->pool_type);
  return 0;
}

static int module_clear(PyObject *module) {
  cpy_state *st = cpy_state_of_module(module);
  if (st == NULL) return 0;
  Py_CLEAR(st->oom_error);
  Py_CLEAR(st->pool_type);
  return 0;
}

static void module_free(void *module) { (void)module_clear((PyObject *)module); }

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, (void *)module_exec},
    {0, NULL},
};

PyDoc_STRVAR(module_doc,
             "cudapool._C — the C core of cudapool: configuration parsing, pools over simulated "
             "devices, and handles of the process-wide device pools.");

struct PyModuleDef cpy_module_def = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "cudapool._C",
    .m_doc = module_doc,
    .m_size = sizeof(cpy_state),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit__C(void);

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&cpy_module_def); }
