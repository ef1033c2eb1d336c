/* module.c — the CPython binding, module cudapool._C.
 * Owns: argument conversion, the mapping of status codes to Python exceptions, and the
 * SimPool type (a pool over the simulated device). No pool logic lives here.
 *
 * Note [GIL]: every SimPool method runs with the GIL held. The sim backend never blocks the
 * host, so nothing here waits on a device; holding the GIL also makes close() safe against
 * concurrent method calls on the same object from other Python threads. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda.h"
#include "backend/sim.h"
#include "core/cp.h"
#include "base/fork.h"
#include "torch/abi.h"
#include "torch/devices.h"

/* ------------------------------------------------------------------------------------------
 * Module state
 * ---------------------------------------------------------------------------------------- */

typedef struct module_state_s {
  PyObject *oom_error;         /* cudapool._C.OutOfMemoryError, a MemoryError */
  PyTypeObject *sim_pool_type; /* cudapool._C.SimPool */
} module_state;

static module_state *module_get_state(PyObject *module) {
  return (module_state *)PyModule_GetState(module);
}

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
 * Errors and conversions
 * ---------------------------------------------------------------------------------------- */

/* Raise the Python exception for a failed core call and return NULL. The core's last error
 * is cleared before every call, so an empty message means the callee set none. */
static PyObject *raise_status(const module_state *st, int status) {
  const char *msg = cp_last_error();
  if (msg == NULL || msg[0] == '\0') msg = cp_status_name(status);
  switch (status) {
    case CP_ERR_OOM:
      PyErr_SetString(st->oom_error, msg);
      break;
    case CP_ERR_INVALID:
      PyErr_SetString(PyExc_ValueError, msg);
      break;
    case CP_ERR_HOST_OOM:
      PyErr_SetString(PyExc_MemoryError, msg);
      break;
    default:
      PyErr_Format(PyExc_RuntimeError, "%s: %s", cp_status_name(status), msg);
      break;
  }
  return NULL;
}

/* A Python int (or __index__) as an unsigned value <= max.
 * Negative: ValueError. Larger than max: OverflowError. Not an integer: TypeError. */
static int as_unsigned(PyObject *obj, const char *what, unsigned long long max,
                       unsigned long long *out) {
  PyObject *index = PyNumber_Index(obj);
  if (index == NULL) return -1;
  int overflow = 0;
  long long value = PyLong_AsLongLongAndOverflow(index, &overflow);
  if (value == -1 && PyErr_Occurred()) {
    Py_DECREF(index);
    return -1;
  }
  unsigned long long result;
  if (overflow < 0 || (overflow == 0 && value < 0)) {
    Py_DECREF(index);
    PyErr_Format(PyExc_ValueError, "%s must be non-negative", what);
    return -1;
  }
  if (overflow > 0) {
    result = PyLong_AsUnsignedLongLong(index);
    if (result == (unsigned long long)-1 && PyErr_Occurred()) {
      Py_DECREF(index);
      if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
        PyErr_Clear();
        PyErr_Format(PyExc_OverflowError, "%s is too large (at most %llu)", what, max);
      }
      return -1;
    }
  } else {
    result = (unsigned long long)value;
  }
  Py_DECREF(index);
  if (result > max) {
    PyErr_Format(PyExc_OverflowError, "%s is too large (at most %llu)", what, max);
    return -1;
  }
  *out = result;
  return 0;
}

static int as_size(PyObject *obj, const char *what, size_t *out) {
  unsigned long long v;
  if (as_unsigned(obj, what, (unsigned long long)SIZE_MAX, &v) < 0) return -1;
  *out = (size_t)v;
  return 0;
}

static int as_uintptr(PyObject *obj, const char *what, uintptr_t *out) {
  unsigned long long v;
  if (as_unsigned(obj, what, (unsigned long long)UINTPTR_MAX, &v) < 0) return -1;
  *out = (uintptr_t)v;
  return 0;
}

static PyObject *from_size(size_t value) { return PyLong_FromSize_t(value); }

static PyObject *from_ptr(const void *ptr) {
  return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)ptr);
}

static int dict_set_i64(PyObject *dict, const char *key, int64_t value) {
  PyObject *v = PyLong_FromLongLong((long long)value);
  if (v == NULL) return -1;
  int rc = PyDict_SetItemString(dict, key, v);
  Py_DECREF(v);
  return rc;
}

static int dict_set_u64(PyObject *dict, const char *key, unsigned long long value) {
  PyObject *v = PyLong_FromUnsignedLongLong(value);
  if (v == NULL) return -1;
  int rc = PyDict_SetItemString(dict, key, v);
  Py_DECREF(v);
  return rc;
}

/* A tuple of the first `n` strings of `names`. */
static PyObject *str_tuple(const char *const *names, size_t n) {
  PyObject *t = PyTuple_New((Py_ssize_t)n);
  if (t == NULL) return NULL;
  for (size_t i = 0; i < n; i++) {
    PyObject *s = PyUnicode_FromString(names[i]);
    if (s == NULL) {
      Py_DECREF(t);
      return NULL;
    }
    PyTuple_SET_ITEM(t, (Py_ssize_t)i, s);
  }
  return t;
}

static PyObject *config_to_str(const cp_config_t *cfg) {
  char small[1024];
  int n = cp_config_format(cfg, small, sizeof small);
  if (n < 0) {
    PyErr_SetString(PyExc_RuntimeError, "cp_config_format failed");
    return NULL;
  }
  if ((size_t)n < sizeof small) return PyUnicode_DecodeUTF8(small, n, "replace");
  char *big = PyMem_Malloc((size_t)n + 1);
  if (big == NULL) return PyErr_NoMemory();
  int m = cp_config_format(cfg, big, (size_t)n + 1);
  PyObject *r = PyUnicode_DecodeUTF8(big, m < n ? m : n, "replace");
  PyMem_Free(big);
  return r;
}

/* ------------------------------------------------------------------------------------------
 * SimPool
 * ---------------------------------------------------------------------------------------- */

typedef struct sim_pool_object_s {
  PyObject_HEAD
  cp_sim_t *sim;   /* NULL once closed */
  cp_pool_t *pool; /* NULL once closed; destroyed before sim */
  size_t capacity;
  cp_replay_t *replay; /* the replay under way, or NULL; destroyed before pool */
} SimPoolObject;

static const char *const stat_metric_names[4] = {"current", "peak", "allocated", "freed"};

/* The module state of the type that defined SimPool (the type is final: no subclasses). */
static module_state *sim_pool_state(PyObject *op) {
  return (module_state *)PyType_GetModuleState(Py_TYPE(op));
}

static int sim_pool_check_open(SimPoolObject *self) {
  if (self->pool == NULL) {
    PyErr_SetString(PyExc_ValueError, "pool is closed");
    return -1;
  }
  return 0;
}

#define SIM_POOL_OPEN(op, self)                         \
  SimPoolObject *self = (SimPoolObject *)(op);          \
  if (sim_pool_check_open(self) < 0) return NULL

static void sim_pool_close_impl(SimPoolObject *self) {
  if (self->replay != NULL) {
    cp_replay_destroy(self->replay);
    self->replay = NULL;
  }
  if (self->pool != NULL) {
    cp_pool_destroy(self->pool);
    self->pool = NULL;
  }
  if (self->sim != NULL) {
    cp_sim_destroy(self->sim);
    self->sim = NULL;
  }
}

static PyObject *SimPool_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"capacity", "config", "auto_complete", "touch_memory", NULL};
  PyObject *capacity_obj = NULL;
  const char *config_text = "";
  int auto_complete = 0;
  int touch_memory = 1;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|spp:SimPool", kwlist, &capacity_obj,
                                   &config_text, &auto_complete, &touch_memory)) {
    return NULL;
  }
  size_t capacity;
  if (as_size(capacity_obj, "capacity", &capacity) < 0) return NULL;
  if (capacity == 0) {
    PyErr_SetString(PyExc_ValueError, "capacity must be > 0");
    return NULL;
  }

  module_state *st = (module_state *)PyType_GetModuleState(type);
  if (st == NULL) return NULL;

  cp_config_t cfg;
  cp_config_default(&cfg);
  cp_clear_error();
  int rc = cp_config_parse(&cfg, config_text);
  if (rc != CP_OK) return raise_status(st, rc);

  SimPoolObject *self = (SimPoolObject *)type->tp_alloc(type, 0);
  if (self == NULL) return NULL;
  self->sim = NULL;
  self->pool = NULL;
  self->capacity = capacity;

  unsigned flags = (auto_complete ? (unsigned)CP_SIM_AUTO_COMPLETE : 0u) |
                   (touch_memory ? 0u : (unsigned)CP_SIM_NO_TOUCH);
  cp_clear_error();
  rc = cp_sim_create(capacity, flags, &self->sim);
  if (rc != CP_OK) {
    self->sim = NULL;
    raise_status(st, rc);
    Py_DECREF(self);
    return NULL;
  }
  cp_backend_t backend;
  cp_sim_backend(self->sim, &backend);
  cp_clear_error();
  rc = cp_pool_create(&cfg, &backend, &self->pool);
  if (rc != CP_OK) {
    self->pool = NULL;
    raise_status(st, rc); /* before the sim goes: its teardown may touch the last error */
    Py_DECREF(self);
    return NULL;
  }
  return (PyObject *)self;
}

static void SimPool_dealloc(PyObject *op) {
  PyTypeObject *tp = Py_TYPE(op);
  sim_pool_close_impl((SimPoolObject *)op);
  freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
  tp_free(op);
  Py_DECREF(tp);
}

static PyObject *SimPool_repr(PyObject *op) {
  SimPoolObject *self = (SimPoolObject *)op;
  if (self->pool == NULL) return PyUnicode_FromString("<cudapool._C.SimPool closed>");
  return PyUnicode_FromFormat("<cudapool._C.SimPool capacity=%zu reserved=%zu>", self->capacity,
                              cp_sim_reserved_bytes(self->sim));
}

static PyObject *SimPool_alloc(PyObject *op, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"size", "stream", NULL};
  PyObject *size_obj = NULL;
  PyObject *stream_obj = NULL;
  SIM_POOL_OPEN(op, self);
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|O:alloc", kwlist, &size_obj, &stream_obj)) {
    return NULL;
  }
  size_t size;
  uintptr_t stream = 0;
  if (as_size(size_obj, "size", &size) < 0) return NULL;
  if (stream_obj != NULL && as_uintptr(stream_obj, "stream", &stream) < 0) return NULL;
  void *ptr = NULL;
  cp_clear_error();
  int rc = cp_alloc(self->pool, size, (cp_stream_t)stream, &ptr);
  if (rc != CP_OK) return raise_status(sim_pool_state(op), rc);
  return from_ptr(ptr);
}

static PyObject *SimPool_free(PyObject *op, PyObject *ptr_obj) {
  SIM_POOL_OPEN(op, self);
  uintptr_t ptr;
  if (as_uintptr(ptr_obj, "ptr", &ptr) < 0) return NULL;
  cp_clear_error();
  int rc = cp_free(self->pool, (void *)ptr);
  if (rc != CP_OK) return raise_status(sim_pool_state(op), rc);
  Py_RETURN_NONE;
}

static PyObject *SimPool_record_stream(PyObject *op, PyObject *args) {
  PyObject *ptr_obj;
  PyObject *stream_obj;
  SIM_POOL_OPEN(op, self);
  if (!PyArg_ParseTuple(args, "OO:record_stream", &ptr_obj, &stream_obj)) return NULL;
  uintptr_t ptr;
  uintptr_t stream;
  if (as_uintptr(ptr_obj, "ptr", &ptr) < 0) return NULL;
  if (as_uintptr(stream_obj, "stream", &stream) < 0) return NULL;
  cp_clear_error();
  int rc = cp_record_stream(self->pool, (void *)ptr, (cp_stream_t)stream);
  if (rc != CP_OK) return raise_status(sim_pool_state(op), rc);
  Py_RETURN_NONE;
}

static PyObject *SimPool_complete(PyObject *op, PyObject *stream_obj) {
  SIM_POOL_OPEN(op, self);
  uintptr_t stream;
  if (as_uintptr(stream_obj, "stream", &stream) < 0) return NULL;
  cp_sim_complete(self->sim, (cp_stream_t)stream);
  Py_RETURN_NONE;
}

static PyObject *SimPool_complete_all(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  SIM_POOL_OPEN(op, self);
  cp_sim_complete_all(self->sim);
  Py_RETURN_NONE;
}

static PyObject *SimPool_empty_cache(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  SIM_POOL_OPEN(op, self);
  cp_clear_error();
  int rc = cp_empty_cache(self->pool);
  if (rc != CP_OK) return raise_status(sim_pool_state(op), rc);
  Py_RETURN_NONE;
}

static PyObject *SimPool_set_memory_cap(PyObject *op, PyObject *bytes_obj) {
  SIM_POOL_OPEN(op, self);
  size_t bytes;
  if (as_size(bytes_obj, "bytes", &bytes) < 0) return NULL;
  cp_clear_error();
  int rc = cp_pool_set_memory_cap(self->pool, bytes);
  if (rc != CP_OK) return raise_status(sim_pool_state(op), rc);
  Py_RETURN_NONE;
}

static PyObject *SimPool_set_memory_fraction(PyObject *op, PyObject *fraction_obj) {
  SIM_POOL_OPEN(op, self);
  double fraction = PyFloat_AsDouble(fraction_obj);
  if (fraction == -1.0 && PyErr_Occurred()) return NULL;
  cp_clear_error();
  int rc = cp_pool_set_memory_fraction(self->pool, fraction);
  if (rc != CP_OK) return raise_status(sim_pool_state(op), rc);
  Py_RETURN_NONE;
}

static int stats_put(PyObject *dict, const char *prefix, const cp_stat_t *stat) {
  const int64_t values[4] = {stat->current, stat->peak, stat->allocated, stat->freed};
  char key[160];
  for (size_t m = 0; m < 4; m++) {
    snprintf(key, sizeof key, "%s.%s", prefix, stat_metric_names[m]);
    if (dict_set_i64(dict, key, values[m]) < 0) return -1;
  }
  return 0;
}

/* The statistics as torch's flat dict ("allocated_bytes.all.current": ...). */
static PyObject *stats_to_dict(const cp_stats_t *stats_in) {
  const cp_stats_t stats = *stats_in;
  PyObject *d = PyDict_New();
  if (d == NULL) return NULL;
  char prefix[128];
  for (size_t f = 0; f < CP_STAT_FAMILY_COUNT; f++) {
    for (size_t k = 0; k < CP_KIND_COUNT; k++) {
      snprintf(prefix, sizeof prefix, "%s.%s", cp_stat_family_names[f], cp_pool_kind_names[k]);
      if (stats_put(d, prefix, &stats.family[f][k]) < 0) goto fail;
    }
  }
  if (stats_put(d, "oversize_allocations", &stats.oversize_allocations) < 0) goto fail;
  if (stats_put(d, "oversize_segments", &stats.oversize_segments) < 0) goto fail;
#define CP_X(name) \
  if (dict_set_i64(d, #name, stats.name) < 0) goto fail;
  CP_STAT_COUNTERS(CP_X)
#undef CP_X
  if (dict_set_i64(d, "max_split_size", stats.max_split_size) < 0) goto fail;
  return d;
fail:
  Py_DECREF(d);
  return NULL;
}

static PyObject *SimPool_stats(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  SIM_POOL_OPEN(op, self);
  cp_stats_t stats;
  cp_pool_stats(self->pool, &stats);
  return stats_to_dict(&stats);
}

/* Every field of cp_pool_info_t, in declaration order. */
#define CP_POOL_INFO_FIELDS(X) \
  X(reserved)                  \
  X(allocated)                 \
  X(cached_free)               \
  X(pending_free)              \
  X(largest_free_block)        \
  X(segments)                  \
  X(free_blocks)               \
  X(live_blocks)               \
  X(pending_blocks)            \
  X(streams)                   \
  X(memory_cap)                \
  X(device_free)               \
  X(device_total)

static PyObject *pool_info_dict(cp_pool_t *pool) {
  cp_pool_info_t info;
  memset(&info, 0, sizeof info);
  if (pool != NULL) cp_pool_info(pool, &info);
  PyObject *d = PyDict_New();
  if (d == NULL) return NULL;
#define CP_X(field) \
  if (dict_set_u64(d, #field, (unsigned long long)info.field) < 0) goto fail;
  CP_POOL_INFO_FIELDS(CP_X)
#undef CP_X
  return d;
fail:
  Py_DECREF(d);
  return NULL;
}

static PyObject *SimPool_info(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  SIM_POOL_OPEN(op, self);
  return pool_info_dict(self->pool);
}

static PyObject *SimPool_reset_peak_stats(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  SIM_POOL_OPEN(op, self);
  cp_pool_reset_peak_stats(self->pool);
  Py_RETURN_NONE;
}

static PyObject *SimPool_reset_accumulated_stats(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  SIM_POOL_OPEN(op, self);
  cp_pool_reset_accumulated_stats(self->pool);
  Py_RETURN_NONE;
}

static PyObject *SimPool_check(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  SIM_POOL_OPEN(op, self);
  return from_size(cp_pool_check(self->pool, NULL));
}

static PyObject *pool_check_report(cp_pool_t *pool) {
  char *buf = NULL;
  size_t len = 0;
  FILE *out = open_memstream(&buf, &len);
  if (out == NULL) return PyErr_SetFromErrno(PyExc_OSError);
  (void)cp_pool_check(pool, out);
  if (fclose(out) != 0) {
    free(buf);
    return PyErr_SetFromErrno(PyExc_OSError);
  }
  PyObject *r = PyUnicode_DecodeUTF8(buf != NULL ? buf : "", (Py_ssize_t)len, "replace");
  free(buf);
  return r;
}

static PyObject *SimPool_check_report(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  SIM_POOL_OPEN(op, self);
  return pool_check_report(self->pool);
}

static PyObject *pool_oom_report(cp_pool_t *pool, PyObject *size_obj) {
  size_t size;
  if (as_size(size_obj, "size", &size) < 0) return NULL;
  char small[4096];
  int n = cp_pool_oom_report(pool, size, small, sizeof small);
  if (n < 0) {
    PyErr_SetString(PyExc_RuntimeError, "cp_pool_oom_report failed");
    return NULL;
  }
  if ((size_t)n < sizeof small) return PyUnicode_DecodeUTF8(small, n, "replace");
  char *big = PyMem_Malloc((size_t)n + 1);
  if (big == NULL) return PyErr_NoMemory();
  int m = cp_pool_oom_report(pool, size, big, (size_t)n + 1);
  PyObject *r = m < 0 ? PyUnicode_FromString("")
                      : PyUnicode_DecodeUTF8(big, m < n ? m : n, "replace");
  PyMem_Free(big);
  return r;
}

static PyObject *SimPool_oom_report(PyObject *op, PyObject *size_obj) {
  SIM_POOL_OPEN(op, self);
  return pool_oom_report(self->pool, size_obj);
}

static PyObject *SimPool_config(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  SIM_POOL_OPEN(op, self);
  cp_config_t cfg;
  cp_pool_config(self->pool, &cfg);
  return config_to_str(&cfg);
}

/* ---- replay of traces ---- */

static PyObject *SimPool_replay_start(PyObject *op, PyObject *args) {
  SIM_POOL_OPEN(op, self);
  int device = -1;
  if (!PyArg_ParseTuple(args, "|i:replay_start", &device)) return NULL;
  if (self->replay != NULL) {
    PyErr_SetString(PyExc_RuntimeError, "a replay is already under way on this pool");
    return NULL;
  }
  cp_clear_error();
  int rc = cp_replay_create(self->pool, device, &self->replay);
  if (rc != CP_OK) return raise_status(sim_pool_state(op), rc);
  Py_RETURN_NONE;
}

static int sim_pool_replay_check(SimPoolObject *self) {
  if (sim_pool_check_open(self) < 0) return -1;
  if (self->replay == NULL) {
    PyErr_SetString(PyExc_RuntimeError, "no replay under way (call replay_start first)");
    return -1;
  }
  return 0;
}

/* replay_feed(buffer, start=0, count=-1) -> bool: events [start, start + count) of a buffer
 * of 40-byte records. False once an allocation failed (see replay_result). */
static PyObject *SimPool_replay_feed(PyObject *op, PyObject *args) {
  SimPoolObject *self = (SimPoolObject *)op;
  if (sim_pool_replay_check(self) < 0) return NULL;
  Py_buffer view;
  Py_ssize_t start = 0, count = -1;
  if (!PyArg_ParseTuple(args, "y*|nn:replay_feed", &view, &start, &count)) return NULL;
  const Py_ssize_t rec = (Py_ssize_t)sizeof(cp_trace_event_t);
  Py_ssize_t total = view.len / rec;
  if (view.len % rec != 0 || start < 0 || start > total || count < -1) {
    PyBuffer_Release(&view);
    PyErr_Format(PyExc_ValueError, "replay_feed: bad range (buffer of %zd bytes, records of %zd, start %zd, count %zd)",
                 view.len, rec, start, count);
    return NULL;
  }
  if (count == -1 || count > total - start) count = total - start;
  /* The records may sit at any address in the buffer: copy through an aligned chunk. */
  enum { CHUNK = 4096 };
  cp_trace_event_t chunk[CHUNK];
  int rc = CP_OK;
  const char *base = (const char *)view.buf + start * rec;
  for (Py_ssize_t done = 0; done < count && rc == CP_OK; done += CHUNK) {
    Py_ssize_t k = count - done < CHUNK ? count - done : CHUNK;
    memcpy(chunk, base + done * rec, (size_t)(k * rec));
    cp_clear_error();
    rc = cp_replay_feed(self->replay, chunk, (size_t)k);
  }
  PyBuffer_Release(&view);
  if (rc == CP_ERR_OOM) Py_RETURN_FALSE;
  if (rc != CP_OK) return raise_status(sim_pool_state(op), rc);
  Py_RETURN_TRUE;
}

static PyObject *SimPool_replay_result(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  SimPoolObject *self = (SimPoolObject *)op;
  if (sim_pool_replay_check(self) < 0) return NULL;
  cp_replay_result_t r;
  cp_replay_result(self->replay, &r);
  return Py_BuildValue(
      "{s:K,s:K,s:K,s:K,s:K,s:n,s:n,s:n,s:n,s:n,s:K,s:K,s:O,s:K,s:K,s:K}", "events", (unsigned long long)r.events,
      "allocs", (unsigned long long)r.allocs, "frees", (unsigned long long)r.frees, "skipped",
      (unsigned long long)r.skipped, "bad_events", (unsigned long long)r.bad_events, "peak_allocated",
      (Py_ssize_t)r.peak_allocated, "peak_requested", (Py_ssize_t)r.peak_requested, "peak_reserved",
      (Py_ssize_t)r.peak_reserved, "cached_free_at_peak", (Py_ssize_t)r.cached_free_at_peak, "largest_free_at_peak",
      (Py_ssize_t)r.largest_free_at_peak, "device_allocs", (unsigned long long)r.device_allocs, "device_frees",
      (unsigned long long)r.device_frees, "oom", r.oom ? Py_True : Py_False, "oom_event",
      (unsigned long long)r.oom_event, "oom_size", (unsigned long long)r.oom_size, "ns", (unsigned long long)r.ns);
}

static PyObject *SimPool_replay_window(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  SimPoolObject *self = (SimPoolObject *)op;
  if (sim_pool_replay_check(self) < 0) return NULL;
  size_t a, r;
  cp_replay_window(self->replay, &a, &r);
  return Py_BuildValue("(nn)", (Py_ssize_t)a, (Py_ssize_t)r);
}

/* End the replay: every allocation still live is freed. */
static PyObject *SimPool_replay_stop(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  SimPoolObject *self = (SimPoolObject *)op;
  if (sim_pool_replay_check(self) < 0) return NULL;
  cp_replay_destroy(self->replay);
  self->replay = NULL;
  Py_RETURN_NONE;
}

static PyObject *SimPool_backend_calls(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  SIM_POOL_OPEN(op, self);
  PyObject *d = PyDict_New();
  if (d == NULL) return NULL;
  for (int i = 0; i < (int)CP_SIM_CALL_COUNT; i++) {
    cp_sim_call_t kind = (cp_sim_call_t)i;
    if (dict_set_u64(d, cp_sim_call_name(kind), (unsigned long long)cp_sim_calls(self->sim, kind)) <
        0) {
      Py_DECREF(d);
      return NULL;
    }
  }
  return d;
}

/* A backend call kind by its name ("reserve", "event_record", ...); ValueError listing the
 * names otherwise. */
static int parse_call_kind(const char *kind_name, cp_sim_call_t *out) {
  for (int i = 0; i < (int)CP_SIM_CALL_COUNT; i++) {
    if (strcmp(cp_sim_call_name((cp_sim_call_t)i), kind_name) == 0) {
      *out = (cp_sim_call_t)i;
      return 0;
    }
  }
  char valid[512];
  size_t used = 0;
  valid[0] = '\0';
  for (int i = 0; i < (int)CP_SIM_CALL_COUNT && used < sizeof valid; i++) {
    int w = snprintf(valid + used, sizeof valid - used, "%s%s", i ? ", " : "", cp_sim_call_name((cp_sim_call_t)i));
    if (w < 0) break;
    used += (size_t)w;
  }
  PyErr_Format(PyExc_ValueError, "unknown backend call '%s' (one of: %s)", kind_name, valid);
  return -1;
}

static PyObject *SimPool_fail_nth(PyObject *op, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"kind", "n", "oom", NULL};
  const char *kind_name = NULL;
  PyObject *n_obj = NULL;
  int oom = 1;
  SIM_POOL_OPEN(op, self);
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "sO|p:fail_nth", kwlist, &kind_name, &n_obj,
                                   &oom)) {
    return NULL;
  }
  cp_sim_call_t found = CP_SIM_RESERVE;
  if (parse_call_kind(kind_name, &found) < 0) return NULL;
  unsigned long long n;
  if (as_unsigned(n_obj, "n", UINT64_MAX, &n) < 0) return NULL;
  cp_sim_fail_nth(self->sim, found, (uint64_t)n, oom ? CP_ERR_OOM : CP_ERR_BACKEND);
  Py_RETURN_NONE;
}

static PyObject *SimPool_sim_reserved_bytes(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  SIM_POOL_OPEN(op, self);
  return from_size(cp_sim_reserved_bytes(self->sim));
}

static PyObject *SimPool_sim_live_reservations(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  SIM_POOL_OPEN(op, self);
  return from_size(cp_sim_live_reservations(self->sim));
}

static PyObject *SimPool_sim_live_events(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  SIM_POOL_OPEN(op, self);
  return from_size(cp_sim_live_events(self->sim));
}

static PyObject *SimPool_invalidate_stream(PyObject *op, PyObject *stream_obj) {
  SIM_POOL_OPEN(op, self);
  uintptr_t stream;
  if (as_uintptr(stream_obj, "stream", &stream) < 0) return NULL;
  cp_clear_error();
  int rc = cp_sim_invalidate_stream(self->sim, (cp_stream_t)stream);
  if (rc != CP_OK) return raise_status(sim_pool_state(op), rc);
  Py_RETURN_NONE;
}

static PyObject *SimPool_close(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  sim_pool_close_impl((SimPoolObject *)op);
  Py_RETURN_NONE;
}

static PyObject *SimPool_get_closed(PyObject *op, void *Py_UNUSED(closure)) {
  return PyBool_FromLong(((SimPoolObject *)op)->pool == NULL);
}

static PyObject *SimPool_get_capacity(PyObject *op, void *Py_UNUSED(closure)) {
  return from_size(((SimPoolObject *)op)->capacity);
}

#define METH_KW(fn) ((PyCFunction)(void (*)(void))(fn))

static PyMethodDef SimPool_methods[] = {
    {"alloc", METH_KW(SimPool_alloc), METH_VARARGS | METH_KEYWORDS,
     "alloc(size, stream=0) -> int\n\nAllocate size bytes for use on stream; 0 for size 0."},
    {"free", SimPool_free, METH_O, "free(ptr)\n\nFree a pointer returned by alloc; 0 is a no-op."},
    {"record_stream", SimPool_record_stream, METH_VARARGS,
     "record_stream(ptr, stream)\n\nMark ptr as used on stream too."},
    {"complete", SimPool_complete, METH_O,
     "complete(stream)\n\nFinish all simulated work submitted to stream so far."},
    {"complete_all", SimPool_complete_all, METH_NOARGS, "Finish all simulated work."},
    {"empty_cache", SimPool_empty_cache, METH_NOARGS,
     "Return every wholly free segment to the device."},
    {"set_memory_cap", SimPool_set_memory_cap, METH_O,
     "set_memory_cap(bytes)\n\nCap the reserved memory (0 = no cap)."},
    {"set_memory_fraction", SimPool_set_memory_fraction, METH_O,
     "set_memory_fraction(fraction)\n\nCap the reserved memory at a fraction of the device."},
    {"stats", SimPool_stats, METH_NOARGS, "The statistics, keyed by the built-in allocator's names."},
    {"info", SimPool_info, METH_NOARGS, "Facts beyond the statistics (cp_pool_info)."},
    {"reset_peak_stats", SimPool_reset_peak_stats, METH_NOARGS, "Set every peak to its current."},
    {"reset_accumulated_stats", SimPool_reset_accumulated_stats, METH_NOARGS,
     "Zero the accumulated statistics and counters."},
    {"check", SimPool_check, METH_NOARGS, "Count invariant violations (0 = healthy)."},
    {"check_report", SimPool_check_report, METH_NOARGS,
     "The invariant violations, one per line (\"\" = healthy)."},
    {"oom_report", SimPool_oom_report, METH_O,
     "oom_report(size) -> str\n\nThe out-of-memory report for a request of size bytes."},
    {"config", SimPool_config, METH_NOARGS, "The configuration the pool runs with, as a string."},
    {"backend_calls", SimPool_backend_calls, METH_NOARGS,
     "Calls made to the simulated device so far, by kind."},
    {"fail_nth", METH_KW(SimPool_fail_nth), METH_VARARGS | METH_KEYWORDS,
     "fail_nth(kind, n, oom=True)\n\nMake the n-th next backend call of kind fail "
     "(out of memory, or a device error when oom is False); n = 0 disarms."},
    {"sim_reserved_bytes", SimPool_sim_reserved_bytes, METH_NOARGS,
     "Bytes the simulated device has handed out."},
    {"sim_live_reservations", SimPool_sim_live_reservations, METH_NOARGS,
     "Reservations live on the simulated device."},
    {"sim_live_events", SimPool_sim_live_events, METH_NOARGS,
     "Events live on the simulated device."},
    {"invalidate_stream", SimPool_invalidate_stream, METH_O,
     "invalidate_stream(stream)\n\nMake stream invalid, as a destroyed one: recording an event "
     "on it fails from now on."},
    {"replay_start", SimPool_replay_start, METH_VARARGS,
     "replay_start(device=-1)\n\nBegin replaying a trace into this pool (device -1: all)."},
    {"replay_feed", SimPool_replay_feed, METH_VARARGS,
     "replay_feed(buffer, start=0, count=-1) -> bool\n\nReplay 40-byte trace records; False once "
     "an allocation failed."},
    {"replay_result", SimPool_replay_result, METH_NOARGS, "The replay's figures so far (dict)."},
    {"replay_window", SimPool_replay_window, METH_NOARGS,
     "(max allocated, max reserved) since the previous call."},
    {"replay_stop", SimPool_replay_stop, METH_NOARGS, "End the replay, freeing what is still live."},
    {"close", SimPool_close, METH_NOARGS,
     "Destroy the pool, then the device. Idempotent."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef SimPool_getset[] = {
    {"closed", SimPool_get_closed, NULL, "True once close() has run.", NULL},
    {"capacity", SimPool_get_capacity, NULL, "The simulated device's capacity in bytes.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(SimPool_doc,
             "SimPool(capacity, config='', auto_complete=False, touch_memory=True)\n\n"
             "A cudapool pool over a simulated device of capacity bytes. config uses the\n"
             "PYTORCH_CUDA_ALLOC_CONF syntax. auto_complete: events complete as soon as\n"
             "recorded. touch_memory=False: addresses are not backed by host memory.");

static PyType_Slot SimPool_slots[] = {
    {Py_tp_new, (void *)SimPool_new},
    {Py_tp_dealloc, (void *)SimPool_dealloc},
    {Py_tp_repr, (void *)SimPool_repr},
    {Py_tp_methods, SimPool_methods},
    {Py_tp_getset, SimPool_getset},
    {Py_tp_doc, (void *)SimPool_doc},
    {0, NULL},
};

#ifdef Py_TPFLAGS_IMMUTABLETYPE
#define CP_TPFLAGS_IMMUTABLE Py_TPFLAGS_IMMUTABLETYPE
#else
#define CP_TPFLAGS_IMMUTABLE 0
#endif

static PyType_Spec SimPool_spec = {
    .name = "cudapool._C.SimPool",
    .basicsize = sizeof(SimPoolObject),
    .itemsize = 0,
    .flags = Py_TPFLAGS_DEFAULT | CP_TPFLAGS_IMMUTABLE, /* final: see sim_pool_state */
    .slots = SimPool_slots,
};

/* ------------------------------------------------------------------------------------------
 * Module functions
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
  return config_to_str(&cfg);
}

/* ------------------------------------------------------------------------------------------
 * The process-wide device pools (the ones torch allocates from)
 * ---------------------------------------------------------------------------------------- */

static int parse_device(PyObject *obj, int *out) {
  int overflow = 0;
  long d = PyLong_AsLongAndOverflow(obj, &overflow);
  if (d == -1 && PyErr_Occurred()) return -1;
  if (overflow != 0) {
    PyErr_Format(PyExc_ValueError, "invalid device %S (expected 0..%d)", obj, CP_MAX_DEVICES - 1);
    return -1;
  }
  if (d < 0 || d >= CP_MAX_DEVICES) {
    PyErr_Format(PyExc_ValueError, "invalid device %ld (expected 0..%d)", d, CP_MAX_DEVICES - 1);
    return -1;
  }
  *out = (int)d;
  return 0;
}

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
  if (rc != CP_OK) return raise_status(module_get_state(module), rc);
  return config_to_str(&cfg);
}

static PyObject *mod_device_config(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored)) {
  cp_config_t cfg;
  cpd_config(&cfg);
  return config_to_str(&cfg);
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
  if (as_size(cap_obj, "capacity", &capacity) < 0) return NULL;
  unsigned flags = (touch ? 0u : CP_SIM_NO_TOUCH) | (auto_complete ? CP_SIM_AUTO_COMPLETE : 0u);
  cp_clear_error();
  int rc = cpd_use_sim(capacity, count, flags);
  if (rc == CP_ERR_STATE) {
    PyErr_SetString(PyExc_RuntimeError, cp_last_error());
    return NULL;
  }
  if (rc != CP_OK) return raise_status(module_get_state(module), rc);
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

/* The stats of a device; all zero (but max_split_size) before its first allocation. */
static PyObject *mod_device_stats(PyObject *Py_UNUSED(module), PyObject *dev) {
  int d;
  if (parse_device(dev, &d) < 0) return NULL;
  cp_stats_t stats;
  cp_pool_t *pool = cpd_pool_if_created(d);
  if (pool != NULL) {
    cp_pool_stats(pool, &stats);
  } else {
    cp_config_t cfg;
    cpd_config(&cfg);
    memset(&stats, 0, sizeof stats);
    stats.max_split_size = cfg.max_split_size == SIZE_MAX ? -1 : (int64_t)cfg.max_split_size;
  }
  return stats_to_dict(&stats);
}

static PyObject *mod_device_info(PyObject *Py_UNUSED(module), PyObject *dev) {
  int d;
  if (parse_device(dev, &d) < 0) return NULL;
  return pool_info_dict(cpd_pool_if_created(d));
}

static PyObject *mod_device_check(PyObject *Py_UNUSED(module), PyObject *dev) {
  int d;
  if (parse_device(dev, &d) < 0) return NULL;
  cp_pool_t *pool = cpd_pool_if_created(d);
  return from_size(pool != NULL ? cp_pool_check(pool, NULL) : 0);
}

static PyObject *mod_device_check_report(PyObject *Py_UNUSED(module), PyObject *dev) {
  int d;
  if (parse_device(dev, &d) < 0) return NULL;
  cp_pool_t *pool = cpd_pool_if_created(d);
  if (pool == NULL) return PyUnicode_FromString("");
  return pool_check_report(pool);
}

static PyObject *mod_device_oom_report(PyObject *Py_UNUSED(module), PyObject *args) {
  PyObject *dev, *size_obj;
  int d;
  if (!PyArg_ParseTuple(args, "OO:device_oom_report", &dev, &size_obj)) return NULL;
  if (parse_device(dev, &d) < 0) return NULL;
  cp_pool_t *pool = cpd_pool_if_created(d);
  if (pool == NULL) return PyUnicode_FromString("");
  return pool_oom_report(pool, size_obj);
}

static PyObject *mod_device_reset_peak_stats(PyObject *Py_UNUSED(module), PyObject *dev) {
  int d;
  if (parse_device(dev, &d) < 0) return NULL;
  cp_pool_t *pool = cpd_pool_if_created(d);
  if (pool != NULL) cp_pool_reset_peak_stats(pool);
  Py_RETURN_NONE;
}

static PyObject *mod_device_reset_accumulated_stats(PyObject *Py_UNUSED(module), PyObject *dev) {
  int d;
  if (parse_device(dev, &d) < 0) return NULL;
  cp_pool_t *pool = cpd_pool_if_created(d);
  if (pool != NULL) cp_pool_reset_accumulated_stats(pool);
  Py_RETURN_NONE;
}

/* empty_cache may wait for device work: without the GIL. */
static PyObject *mod_device_empty_cache(PyObject *module, PyObject *dev) {
  int d;
  if (parse_device(dev, &d) < 0) return NULL;
  cp_pool_t *pool = cpd_pool_if_created(d);
  if (pool == NULL) Py_RETURN_NONE;
  int rc;
  cp_clear_error();
  Py_BEGIN_ALLOW_THREADS
  rc = cp_empty_cache(pool);
  Py_END_ALLOW_THREADS
  if (rc != CP_OK) return raise_status(module_get_state(module), rc);
  Py_RETURN_NONE;
}

static PyObject *mod_device_set_memory_fraction(PyObject *module, PyObject *args) {
  double fraction;
  PyObject *dev;
  int d;
  if (!PyArg_ParseTuple(args, "dO:device_set_memory_fraction", &fraction, &dev)) return NULL;
  if (parse_device(dev, &d) < 0) return NULL;
  cp_clear_error();
  int rc = cpd_set_memory_fraction(fraction, d);
  if (rc != CP_OK) return raise_status(module_get_state(module), rc);
  Py_RETURN_NONE;
}

/* For tests: the entry point torch calls, with its C++ exception caught on the C++ side. */

static PyObject *mod_alloc_catching(PyObject *Py_UNUSED(module), PyObject *args) {
  PyObject *size_obj, *stream_obj;
  int device;
  if (!PyArg_ParseTuple(args, "OiO:alloc_catching", &size_obj, &device, &stream_obj)) return NULL;
  size_t size;
  uintptr_t stream;
  if (as_size(size_obj, "size", &size) < 0 || as_uintptr(stream_obj, "stream", &stream) < 0) return NULL;
  void *ptr = NULL;
  char msg[4096];
  msg[0] = '\0';
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = cudapool_alloc_catching(size, device, (void *)stream, &ptr, msg, sizeof msg);
  Py_END_ALLOW_THREADS
  return Py_BuildValue("(Nis)", from_ptr(ptr), rc, msg);
}

static PyObject *mod_sim_complete_all(PyObject *Py_UNUSED(module), PyObject *dev) {
  int d;
  if (parse_device(dev, &d) < 0) return NULL;
  cp_sim_t *sim = cpd_sim(d);
  if (sim != NULL) cp_sim_complete_all(sim);
  Py_RETURN_NONE;
}

/* The simulated device behind `device`'s pool; RuntimeError when there is none (not in sim
 * mode, or the device has not allocated yet). */
static cp_sim_t *existing_sim(int device) {
  cp_sim_t *sim = cpd_sim(device);
  if (sim == NULL) {
    PyErr_Format(PyExc_RuntimeError, "device %d has no simulated device yet (use_sim_devices, then allocate)",
                 device);
  }
  return sim;
}

static PyObject *mod_sim_delay_nth(PyObject *Py_UNUSED(module), PyObject *args) {
  PyObject *dev, *n_obj, *ms_obj;
  const char *kind_name;
  if (!PyArg_ParseTuple(args, "OsOO:sim_delay_nth", &dev, &kind_name, &n_obj, &ms_obj)) return NULL;
  int d;
  cp_sim_call_t kind = CP_SIM_RESERVE;
  unsigned long long n, ms;
  if (parse_device(dev, &d) < 0 || parse_call_kind(kind_name, &kind) < 0) return NULL;
  if (as_unsigned(n_obj, "n", UINT64_MAX, &n) < 0 || as_unsigned(ms_obj, "ms", 60000, &ms) < 0) return NULL;
  cp_sim_t *sim = existing_sim(d);
  if (sim == NULL) return NULL;
  cp_sim_delay_nth(sim, kind, (uint64_t)n, (unsigned)ms);
  Py_RETURN_NONE;
}

static PyObject *mod_sim_delays_entered(PyObject *Py_UNUSED(module), PyObject *dev) {
  int d;
  if (parse_device(dev, &d) < 0) return NULL;
  cp_sim_t *sim = existing_sim(d);
  if (sim == NULL) return NULL;
  return PyLong_FromUnsignedLongLong((unsigned long long)cp_sim_delays_entered(sim));
}

static PyObject *mod_sim_set_lost(PyObject *Py_UNUSED(module), PyObject *args) {
  PyObject *dev;
  int lost = 1;
  if (!PyArg_ParseTuple(args, "O|p:sim_set_lost", &dev, &lost)) return NULL;
  int d;
  if (parse_device(dev, &d) < 0) return NULL;
  cp_sim_t *sim = existing_sim(d);
  if (sim == NULL) return NULL;
  cp_sim_set_lost(sim, lost);
  Py_RETURN_NONE;
}

static PyObject *mod_sim_invalidate_stream(PyObject *module, PyObject *args) {
  PyObject *dev, *stream_obj;
  if (!PyArg_ParseTuple(args, "OO:sim_invalidate_stream", &dev, &stream_obj)) return NULL;
  int d;
  uintptr_t stream;
  if (parse_device(dev, &d) < 0 || as_uintptr(stream_obj, "stream", &stream) < 0) return NULL;
  cp_sim_t *sim = existing_sim(d);
  if (sim == NULL) return NULL;
  cp_clear_error();
  int rc = cp_sim_invalidate_stream(sim, (cp_stream_t)stream);
  if (rc != CP_OK) return raise_status(module_get_state(module), rc);
  Py_RETURN_NONE;
}

static PyObject *mod_interpreter_exiting(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored)) {
  cpd_set_exiting();
  Py_RETURN_NONE;
}

static PyObject *mod_failures_at_exit(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored)) {
  return PyLong_FromUnsignedLong(cpd_failures_at_exit());
}

static PyObject *mod_fork_count(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored)) {
  return PyLong_FromUnsignedLong(cp_fork_count());
}

static PyObject *mod_shutdown(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored)) {
  Py_BEGIN_ALLOW_THREADS
  cpd_shutdown();
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

/* What the CUDA driver says, without raising: {"available", "error", "driver_version",
 * "device_count", "devices": [names]}. */
static PyObject *mod_cuda_info(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored)) {
  int rc, version = 0, count = 0;
  Py_BEGIN_ALLOW_THREADS
  rc = cp_cuda_load();
  if (rc == CP_OK) rc = cp_cuda_driver_version(&version);
  if (rc == CP_OK) rc = cp_cuda_device_count(&count);
  Py_END_ALLOW_THREADS
  PyObject *names = PyList_New(0);
  if (names == NULL) return NULL;
  for (int d = 0; rc == CP_OK && d < count; d++) {
    char name[256] = "";
    if (cp_cuda_device_name(d, name, sizeof name) != CP_OK) snprintf(name, sizeof name, "?");
    PyObject *n = PyUnicode_FromString(name);
    if (n == NULL || PyList_Append(names, n) < 0) {
      Py_XDECREF(n);
      Py_DECREF(names);
      return NULL;
    }
    Py_DECREF(n);
  }
  return Py_BuildValue("{s:O,s:s,s:i,s:i,s:N}", "available", rc == CP_OK && count > 0 ? Py_True : Py_False,
                       "error", rc == CP_OK ? "" : cp_last_error(), "driver_version", version, "device_count",
                       count, "devices", names);
}

static PyMethodDef module_methods[] = {
    {"parse_config", mod_parse_config, METH_VARARGS,
     "parse_config(text) -> str\n\nParse a PYTORCH_CUDA_ALLOC_CONF-style string onto the "
     "defaults and return the resulting configuration, formatted. ValueError if invalid."},
    {"configure", mod_configure, METH_VARARGS,
     "configure(text) -> str\n\nSet the configuration of the device pools (defaults + text). "
     "RuntimeError once a device pool exists; ValueError for a bad key or value."},
    {"device_config", mod_device_config, METH_NOARGS, "The device pools' configuration, formatted."},
    {"use_sim_devices", METH_KW(mod_use_sim_devices), METH_VARARGS | METH_KEYWORDS,
     "use_sim_devices(capacity, count=1, touch_memory=True, auto_complete=True)\n\n"
     "Serve the device pools from simulated devices (before any pool exists)."},
    {"using_sim_devices", mod_using_sim_devices, METH_NOARGS, "True when devices are simulated."},
    {"device_pools", mod_device_pools, METH_NOARGS, "The devices whose pool exists."},
    {"device_stats", mod_device_stats, METH_O, "device_stats(device) -> dict (torch's key names)."},
    {"device_info", mod_device_info, METH_O, "device_info(device) -> dict."},
    {"device_check", mod_device_check, METH_O, "device_check(device) -> invariant violations."},
    {"device_check_report", mod_device_check_report, METH_O, "device_check_report(device) -> str."},
    {"device_oom_report", mod_device_oom_report, METH_VARARGS, "device_oom_report(device, size) -> str."},
    {"device_reset_peak_stats", mod_device_reset_peak_stats, METH_O, "Set every peak to its current."},
    {"device_reset_accumulated_stats", mod_device_reset_accumulated_stats, METH_O,
     "Zero the accumulated counters."},
    {"device_empty_cache", mod_device_empty_cache, METH_O, "Return the device's wholly free segments."},
    {"device_set_memory_fraction", mod_device_set_memory_fraction, METH_VARARGS,
     "device_set_memory_fraction(fraction, device)"},
    {"alloc_catching", mod_alloc_catching, METH_VARARGS,
     "alloc_catching(size, device, stream) -> (ptr, status, message)\n\nThe allocation entry "
     "point torch calls, with its exception caught: for tests."},
    {"sim_complete_all", mod_sim_complete_all, METH_O, "Finish all work of a simulated device."},
    {"sim_delay_nth", mod_sim_delay_nth, METH_VARARGS,
     "sim_delay_nth(device, kind, n, ms)\n\nMake the n-th next backend call of kind on a simulated "
     "device sleep ms milliseconds with its locks held (n = 0 disarms)."},
    {"sim_delays_entered", mod_sim_delays_entered, METH_O, "How many delays have started on the device."},
    {"sim_set_lost", mod_sim_set_lost, METH_VARARGS,
     "sim_set_lost(device, lost=True)\n\nEvery backend call of the simulated device fails from "
     "now on, as after the driver shut down."},
    {"sim_invalidate_stream", mod_sim_invalidate_stream, METH_VARARGS,
     "sim_invalidate_stream(device, stream)\n\nMake a stream of the simulated device invalid, as a "
     "destroyed one: recording an event on it fails from now on."},
    {"interpreter_exiting", mod_interpreter_exiting, METH_NOARGS,
     "Called at interpreter exit: from now on failed frees are counted, not printed."},
    {"failures_at_exit", mod_failures_at_exit, METH_NOARGS,
     "How many entry-point failures were counted silently since interpreter_exiting()."},
    {"fork_count", mod_fork_count, METH_NOARGS, "How many fork() calls cudapool's handlers saw."},
    {"shutdown", mod_shutdown, METH_NOARGS,
     "Destroy every device pool (all memory goes back); later use creates fresh ones."},
    {"cuda_info", mod_cuda_info, METH_NOARGS, "What the CUDA driver says (never raises)."},
    {NULL, NULL, 0, NULL},
};

/* ------------------------------------------------------------------------------------------
 * Module definition (multi-phase init)
 * ---------------------------------------------------------------------------------------- */

static int module_exec(PyObject *module) {
  module_state *st = module_get_state(module);
  if (st == NULL) return -1;

  st->oom_error = PyErr_NewExceptionWithDoc(
      "cudapool._C.OutOfMemoryError",
      "The pool could not get device memory (or hit its memory cap).", PyExc_MemoryError, NULL);
  if (st->oom_error == NULL) return -1;
  if (module_add_ref(module, "OutOfMemoryError", st->oom_error) < 0) return -1;

  st->sim_pool_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &SimPool_spec, NULL);
  if (st->sim_pool_type == NULL) return -1;
  if (PyModule_AddType(module, st->sim_pool_type) < 0) return -1;

  if (PyModule_AddStringConstant(module, "__version__", CP_VERSION) < 0) return -1;
  if (module_add_new(module, "STAT_FAMILIES",
                     str_tuple(cp_stat_family_names, CP_STAT_FAMILY_COUNT)) < 0) {
    return -1;
  }
  if (module_add_new(module, "POOL_KINDS", str_tuple(cp_pool_kind_names, CP_KIND_COUNT)) < 0) {
    return -1;
  }
  if (module_add_new(module, "STAT_METRICS", str_tuple(stat_metric_names, 4)) < 0) return -1;

  static const char *const counter_names[] = {
#define CP_X(name) #name,
      CP_STAT_COUNTERS(CP_X)
#undef CP_X
  };
  if (module_add_new(module, "STAT_COUNTERS",
                     str_tuple(counter_names, sizeof counter_names / sizeof counter_names[0])) <
      0) {
    return -1;
  }

  const char *sim_calls[CP_SIM_CALL_COUNT];
  for (int i = 0; i < (int)CP_SIM_CALL_COUNT; i++) sim_calls[i] = cp_sim_call_name((cp_sim_call_t)i);
  if (module_add_new(module, "SIM_CALLS", str_tuple(sim_calls, CP_SIM_CALL_COUNT)) < 0) return -1;
  return 0;
}

static int module_traverse(PyObject *module, visitproc visit, void *arg) {
  module_state *st = module_get_state(module);
  if (st == NULL) return 0;
  Py_VISIT(st->oom_error);
  Py_VISIT(st->sim_pool_type);
  return 0;
}

static int module_clear(PyObject *module) {
  module_state *st = module_get_state(module);
  if (st == NULL) return 0;
  Py_CLEAR(st->oom_error);
  Py_CLEAR(st->sim_pool_type);
  return 0;
}

static void module_free(void *module) { (void)module_clear((PyObject *)module); }

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, (void *)module_exec},
    {0, NULL},
};

PyDoc_STRVAR(module_doc,
             "cudapool._C — the C core of cudapool: configuration parsing and a pool over a "
             "simulated device.");

static struct PyModuleDef module_def = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "cudapool._C",
    .m_doc = module_doc,
    .m_size = sizeof(module_state),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit__C(void);

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&module_def); }
