/* pool.c — the pool-handle type cudapool._C.Pool: an owned pool over a simulated device, or a
 * handle naming one device of the process-wide table. Owns no pool logic: it converts and calls.
 *
 * Note [Pool handles]: a Pool is one of two kinds.
 *   - A simulated pool (Pool(capacity, config, ...)): the object owns a simulated device, a pool
 *     over it and possibly a replay; close() (or dealloc) destroys them, after which every
 *     method raises ValueError "pool is closed".
 *   - A device handle (device_pool(d)): it owns nothing and remembers only d. Each call looks
 *     the pool up in the device table again (cpd_pool_if_created), so a handle never dangles
 *     after cpd_shutdown: it sees the fresh pool, or none. A device without a pool reads as an
 *     empty one (zero statistics but max_split_size, zero info, no violations, "" reports);
 *     resets and empty_cache then do nothing, and set_memory_fraction creates the pool.
 * The methods that read or tend the pool (statistics, info, check, reports, resets,
 * empty_cache, set_memory_fraction, config) are written once for both kinds. The others
 * drive a simulated pool directly (alloc, free, record_stream, set_memory_cap, the simulated
 * device's controls, replay, close) and raise TypeError on a device handle: device pools are
 * allocated from through the entry points torch calls (torch/devices.h), not through here.
 *
 * Note [GIL]: every method runs with the GIL held, except empty_cache on a device handle (it
 * may wait for device work). The sim backend never blocks the host, so nothing else waits on
 * a device; holding the GIL also makes close() safe against concurrent method calls on the
 * same object from other Python threads.
 *
 * Note [Subclassing Pool]: cudapool.sim.Pool subclasses Pool in Python, so Py_TYPE(self) may
 * be a type no module defined. The methods find cudapool._C's state through the type's bases
 * (cpy_state_of_type), and dealloc frees with the object's own type's tp_free. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/sim.h"
#include "core/cp.h"
#include "python/convert.h"
#include "python/module.h"
#include "python/stacks.h"
#include "torch/abi.h"
#include "torch/devices.h"

typedef struct pool_object_s {
  PyObject_HEAD int device; /* >= 0: a handle naming that device; -1: a simulated pool */
  cp_sim_t *sim;            /* simulated pool: the device; NULL once closed */
  cp_pool_t *pool;          /* simulated pool: the pool; NULL once closed; destroyed before sim */
  size_t capacity;          /* simulated pool: the device's capacity */
  cp_replay_t *replay;      /* simulated pool: the replay under way, or NULL; destroyed before pool */
} PoolObject;

/* ------------------------------------------------------------------------------------------
 * Kinds, state and errors
 * ---------------------------------------------------------------------------------------- */

static PyObject *raise_status(PyObject *op, int status) {
  cpy_state *st = cpy_state_of_type(Py_TYPE(op));
  if (st == NULL) return NULL;
  return cpy_raise_status(st->oom_error, status);
}

static int check_open(PoolObject *self) {
  if (self->device < 0 && self->pool == NULL) {
    PyErr_SetString(PyExc_ValueError, "pool is closed");
    return -1;
  }
  return 0;
}

/* `what` needs a simulated pool: TypeError on a device handle, ValueError once closed. */
static int require_sim(PoolObject *self, const char *what) {
  if (self->device >= 0) {
    PyErr_Format(PyExc_TypeError, "%s needs a simulated pool; this Pool is a handle of device %d's pool", what,
                 self->device);
    return -1;
  }
  return check_open(self);
}

/* The pool a method of either kind acts on; NULL for a device without a pool (not an error). */
static int resolve_pool(PoolObject *self, cp_pool_t **out) {
  if (check_open(self) < 0) return -1;
  *out = self->device >= 0 ? cpd_pool_if_created(self->device) : self->pool;
  return 0;
}

#define SIM_ONLY(op, self, what)         \
  PoolObject *self = (PoolObject *)(op); \
  if (require_sim(self, what) < 0) return NULL

#define ANY_POOL(op, self, pool)         \
  PoolObject *self = (PoolObject *)(op); \
  cp_pool_t *pool;                       \
  if (resolve_pool(self, &pool) < 0) return NULL

/* ------------------------------------------------------------------------------------------
 * Lifetime
 * ---------------------------------------------------------------------------------------- */

static void close_impl(PoolObject *self) {
  if (self->replay != NULL) {
    cp_replay_destroy(self->replay);
    self->replay = NULL;
  }
  if (self->pool != NULL) {
    /* The device finishes its queued work first (cp_pool_destroy's contract): closing is the
     * owner saying it is done with every block. */
    if (self->sim != NULL) cp_sim_complete_all(self->sim);
    cp_pool_destroy(self->pool);
    self->pool = NULL;
  }
  if (self->sim != NULL) {
    cp_sim_destroy(self->sim);
    self->sim = NULL;
  }
}

static PoolObject *pool_alloc_object(PyTypeObject *type) {
  PoolObject *self = (PoolObject *)type->tp_alloc(type, 0);
  if (self == NULL) return NULL;
  self->device = -1;
  self->sim = NULL;
  self->pool = NULL;
  self->capacity = 0;
  self->replay = NULL;
  return self;
}

PyObject *cpy_pool_for_device(cpy_state *st, int device) {
  PoolObject *self = pool_alloc_object(st->pool_type);
  if (self == NULL) return NULL;
  self->device = device;
  return (PyObject *)self;
}

static PyObject *Pool_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"capacity", "config", "auto_complete", "touch_memory", NULL};
  PyObject *capacity_obj = NULL;
  const char *config_text = "";
  int auto_complete = 0;
  int touch_memory = 1;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|spp:Pool", kwlist, &capacity_obj, &config_text, &auto_complete,
                                   &touch_memory)) {
    return NULL;
  }
  size_t capacity;
  if (cpy_as_size(capacity_obj, "capacity", &capacity) < 0) return NULL;
  if (capacity == 0) {
    PyErr_SetString(PyExc_ValueError, "capacity must be > 0");
    return NULL;
  }

  cpy_state *st = cpy_state_of_type(type);
  if (st == NULL) return NULL;

  cp_config_t cfg;
  cp_config_default(&cfg);
  cp_clear_error();
  int rc = cp_config_parse(&cfg, config_text);
  if (rc != CP_OK) return cpy_raise_status(st->oom_error, rc);

  PoolObject *self = pool_alloc_object(type);
  if (self == NULL) return NULL;
  self->capacity = capacity;

  unsigned flags =
      (auto_complete ? (unsigned)CP_SIM_AUTO_COMPLETE : 0u) | (touch_memory ? 0u : (unsigned)CP_SIM_NO_TOUCH);
  cp_clear_error();
  rc = cp_sim_create(capacity, flags, &self->sim);
  if (rc != CP_OK) {
    self->sim = NULL;
    cpy_raise_status(st->oom_error, rc);
    Py_DECREF(self);
    return NULL;
  }
  cp_backend_t backend;
  cp_sim_backend(self->sim, &backend);
  cp_clear_error();
  rc = cp_pool_create(&cfg, &backend, &self->pool);
  if (rc != CP_OK) {
    self->pool = NULL;
    cpy_raise_status(st->oom_error, rc); /* before the sim goes: its teardown may touch the last error */
    Py_DECREF(self);
    return NULL;
  }
  return (PyObject *)self;
}

static void Pool_dealloc(PyObject *op) {
  PyTypeObject *tp = Py_TYPE(op);
  close_impl((PoolObject *)op);
  freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
  tp_free(op);
  Py_DECREF(tp);
}

static PyObject *Pool_repr(PyObject *op) {
  PoolObject *self = (PoolObject *)op;
  if (self->device >= 0) return PyUnicode_FromFormat("<cudapool._C.Pool device=%d>", self->device);
  if (self->pool == NULL) return PyUnicode_FromString("<cudapool._C.Pool closed>");
  return PyUnicode_FromFormat("<cudapool._C.Pool capacity=%zu reserved=%zu>", self->capacity,
                              cp_sim_reserved_bytes(self->sim));
}

static PyObject *Pool_close(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  PoolObject *self = (PoolObject *)op;
  if (self->device >= 0) { /* a device pool lives until shutdown() */
    (void)require_sim(self, "close()");
    return NULL;
  }
  close_impl(self); /* idempotent */
  Py_RETURN_NONE;
}

static PyObject *Pool_get_closed(PyObject *op, void *Py_UNUSED(closure)) {
  PoolObject *self = (PoolObject *)op;
  return PyBool_FromLong(self->device < 0 && self->pool == NULL);
}

static PyObject *Pool_get_capacity(PyObject *op, void *Py_UNUSED(closure)) {
  PoolObject *self = (PoolObject *)op;
  if (self->device >= 0) {
    (void)require_sim(self, "capacity");
    return NULL;
  }
  return cpy_from_size(self->capacity);
}

static PyObject *Pool_get_device(PyObject *op, void *Py_UNUSED(closure)) {
  PoolObject *self = (PoolObject *)op;
  if (self->device < 0) Py_RETURN_NONE;
  return PyLong_FromLong(self->device);
}

/* ------------------------------------------------------------------------------------------
 * Either kind: statistics, reports, cache and limits
 * ---------------------------------------------------------------------------------------- */

static PyObject *Pool_stats(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  ANY_POOL(op, self, pool);
  cp_stats_t stats;
  if (pool != NULL) {
    cp_pool_stats(pool, &stats);
  } else { /* a device before its first allocation: all zero, but the configured max_split_size */
    cp_config_t cfg;
    cpd_config(&cfg);
    memset(&stats, 0, sizeof stats);
    stats.max_split_size = cfg.max_split_size == SIZE_MAX ? -1 : (int64_t)cfg.max_split_size;
  }
  return cpy_stats_to_dict(&stats);
}

static PyObject *Pool_info(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  ANY_POOL(op, self, pool);
  cp_pool_info_t info;
  memset(&info, 0, sizeof info);
  if (pool != NULL) cp_pool_info(pool, &info);
  return cpy_info_to_dict(&info);
}

static PyObject *Pool_reset_peak_stats(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  ANY_POOL(op, self, pool);
  if (pool != NULL) cp_pool_reset_peak_stats(pool);
  Py_RETURN_NONE;
}

static PyObject *Pool_reset_accumulated_stats(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  ANY_POOL(op, self, pool);
  if (pool != NULL) cp_pool_reset_accumulated_stats(pool);
  Py_RETURN_NONE;
}

/* A simulated pool's check counts the device faults too (what a GPU would have faulted on:
 * Note [Simulated asynchrony] in backend/sim.h), so that every test checking a pool sees them. */
static PyObject *Pool_check(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  ANY_POOL(op, self, pool);
  size_t n = pool != NULL ? cp_pool_check(pool, NULL) : 0;
  if (pool != NULL && self->sim != NULL) n += (size_t)cp_sim_device_faults(self->sim);
  return cpy_from_size(n);
}

static PyObject *Pool_check_report(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  ANY_POOL(op, self, pool);
  if (pool == NULL) return PyUnicode_FromString("");
  char *buf = NULL;
  size_t len = 0;
  FILE *out = open_memstream(&buf, &len);
  if (out == NULL) return PyErr_SetFromErrno(PyExc_OSError);
  (void)cp_pool_check(pool, out);
  if (self->sim != NULL) (void)cp_sim_print_device_faults(self->sim, out);
  if (fclose(out) != 0) {
    free(buf);
    return PyErr_SetFromErrno(PyExc_OSError);
  }
  PyObject *r = PyUnicode_DecodeUTF8(buf != NULL ? buf : "", (Py_ssize_t)len, "replace");
  free(buf);
  return r;
}

/* ------------------------------------------------------------------------------------------
 * Either kind: snapshot and history
 * ---------------------------------------------------------------------------------------- */

static const char *const snap_state_names[] = {"free",    "live",      "pending", "unmapped",
                                               "mapping", "unmapping", "lent",    "draining"};

/* One segment of a snapshot as a dict; its blocks as (addr, size, requested, state) tuples. */
static PyObject *snapshot_segment(const cp_snapshot_t *snap, const cp_snapshot_segment_t *s) {
  PyObject *blocks = PyList_New((Py_ssize_t)s->block_count);
  if (blocks == NULL) return NULL;
  for (size_t k = 0; k < s->block_count; k++) {
    const cp_snapshot_block_t *b = &snap->blocks[s->first_block + k];
    const char *state = b->state >= 0 && b->state <= CP_SNAP_DRAINING ? snap_state_names[b->state] : "unknown";
    PyObject *t = Py_BuildValue("(KKKs)", (unsigned long long)b->addr, (unsigned long long)b->size,
                                (unsigned long long)b->requested, state);
    if (t == NULL) {
      Py_DECREF(blocks);
      return NULL;
    }
    PyList_SET_ITEM(blocks, (Py_ssize_t)k, t);
  }
  return Py_BuildValue("{sKsKsKsKsssOsN}", "address", (unsigned long long)s->addr, "size", (unsigned long long)s->size,
                       "mapped", (unsigned long long)s->mapped, "stream", (unsigned long long)s->stream, "kind",
                       s->kind == CP_KIND_SMALL ? "small" : "large", "page_mapped", s->page_mapped ? Py_True : Py_False,
                       "blocks", blocks);
}

static PyObject *Pool_snapshot(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  ANY_POOL(op, self, pool);
  PyObject *list = PyList_New(0);
  if (list == NULL || pool == NULL) return list;
  cp_snapshot_t snap;
  cp_clear_error();
  int rc = cp_pool_snapshot(pool, &snap);
  if (rc != CP_OK) {
    Py_DECREF(list);
    return raise_status(op, rc);
  }
  for (size_t i = 0; i < snap.segment_count; i++) {
    PyObject *seg = snapshot_segment(&snap, &snap.segments[i]);
    if (seg == NULL || PyList_Append(list, seg) < 0) {
      Py_XDECREF(seg);
      Py_CLEAR(list);
      break;
    }
    Py_DECREF(seg);
  }
  cp_snapshot_free(&snap);
  return list;
}

static PyObject *Pool_set_history(PyObject *op, PyObject *entries_obj) {
  SIM_ONLY(op, self, "set_history()");
  size_t entries;
  if (cpy_as_size(entries_obj, "max_entries", &entries) < 0) return NULL;
  cp_clear_error();
  int rc = cp_pool_history_enable(self->pool, entries);
  if (rc != CP_OK) return raise_status(op, rc);
  Py_RETURN_NONE;
}

static PyObject *Pool_history(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  ANY_POOL(op, self, pool);
  size_t capacity = 0;
  uint64_t recorded = 0;
  cp_pool_history_read(pool, NULL, 0, &recorded, &capacity);
  cp_history_entry_t *ring = NULL;
  size_t n = 0;
  if (capacity > 0) {
    ring = PyMem_Malloc(capacity * sizeof *ring);
    if (ring == NULL) return PyErr_NoMemory();
    n = cp_pool_history_read(pool, ring, capacity, &recorded, &capacity); /* may have shrunk: n fits */
  }
  PyObject *list = PyList_New((Py_ssize_t)n);
  for (size_t i = 0; list != NULL && i < n; i++) {
    const cp_history_entry_t *e = &ring[i];
    const char *action = e->action < CP_HIST_ACTION_COUNT ? cp_history_action_names[e->action] : "unknown";
    PyObject *t = Py_BuildValue("(KLsKKKK)", (unsigned long long)e->seq, (long long)e->time_ns, action,
                                (unsigned long long)e->addr, (unsigned long long)e->size, (unsigned long long)e->stream,
                                (unsigned long long)e->context);
    if (t == NULL) {
      Py_CLEAR(list);
      break;
    }
    PyList_SET_ITEM(list, (Py_ssize_t)i, t);
  }
  PyMem_Free(ring);
  if (list == NULL) return NULL;
  return Py_BuildValue("(NKn)", list, (unsigned long long)recorded, (Py_ssize_t)capacity);
}

static PyObject *Pool_oom_report(PyObject *op, PyObject *size_obj) {
  ANY_POOL(op, self, pool);
  size_t size;
  if (cpy_as_size(size_obj, "size", &size) < 0) return NULL;
  if (pool == NULL) return PyUnicode_FromString("");
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
  PyObject *r = m < 0 ? PyUnicode_FromString("") : PyUnicode_DecodeUTF8(big, m < n ? m : n, "replace");
  PyMem_Free(big);
  return r;
}

static PyObject *Pool_last_oom(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  ANY_POOL(op, self, pool);
  cp_oom_info_t in;
  if (pool == NULL || !cp_pool_last_oom(pool, &in)) Py_RETURN_NONE;
  return cpy_oom_to_dict(&in);
}

/* {"capacity", "first", "next", "events": bytes, "live": bytes}: the event log and the live
 * blocks, as 40-byte trace records (cp_pool_event_log). */
static PyObject *Pool_event_log(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  ANY_POOL(op, self, pool);
  cp_event_log_t log;
  memset(&log, 0, sizeof log);
  if (pool != NULL) {
    cp_clear_error();
    int rc = cp_pool_event_log(pool, &log);
    if (rc != CP_OK) return raise_status(op, rc);
  }
  PyObject *r = Py_BuildValue("{s:n,s:K,s:K,s:y#,s:y#}", "capacity", (Py_ssize_t)log.capacity, "first",
                              (unsigned long long)log.first, "next", (unsigned long long)log.next, "events",
                              (const char *)log.events, (Py_ssize_t)(log.n_events * sizeof(cp_trace_event_t)), "live",
                              (const char *)log.live, (Py_ssize_t)(log.n_live * sizeof(cp_trace_event_t)));
  cp_event_log_release(&log);
  return r;
}

static PyObject *Pool_config(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  ANY_POOL(op, self, pool);
  cp_config_t cfg;
  if (pool != NULL) {
    cp_pool_config(pool, &cfg);
  } else {
    cpd_config(&cfg);
  }
  return cpy_config_to_str(&cfg);
}

/* Without the GIL for a device pool: it may wait for device work (Note [GIL]). */
static PyObject *Pool_empty_cache(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  ANY_POOL(op, self, pool);
  if (pool == NULL) Py_RETURN_NONE;
  int rc;
  cp_clear_error();
  if (self->device >= 0) {
    Py_BEGIN_ALLOW_THREADS rc = cp_empty_cache(pool);
    Py_END_ALLOW_THREADS
  } else {
    rc = cp_empty_cache(pool);
  }
  if (rc != CP_OK) return raise_status(op, rc);
  Py_RETURN_NONE;
}

/* On a device handle through the device table, which checks the fraction before creating the
 * pool (so a bad fraction leaves the configuration open). */
static PyObject *Pool_set_memory_fraction(PyObject *op, PyObject *fraction_obj) {
  ANY_POOL(op, self, pool);
  double fraction = PyFloat_AsDouble(fraction_obj);
  if (fraction == -1.0 && PyErr_Occurred()) return NULL;
  cp_clear_error();
  int rc =
      self->device >= 0 ? cpd_set_memory_fraction(fraction, self->device) : cp_pool_set_memory_fraction(pool, fraction);
  if (rc != CP_OK) return raise_status(op, rc);
  Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------------------------
 * Simulated pools only: allocation and the cap
 * ---------------------------------------------------------------------------------------- */

static PyObject *Pool_alloc(PyObject *op, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"size", "stream", NULL};
  PyObject *size_obj = NULL;
  PyObject *stream_obj = NULL;
  SIM_ONLY(op, self, "alloc()");
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|O:alloc", kwlist, &size_obj, &stream_obj)) return NULL;
  size_t size;
  uintptr_t stream = 0;
  if (cpy_as_size(size_obj, "size", &size) < 0) return NULL;
  if (stream_obj != NULL && cpy_as_uintptr(stream_obj, "stream", &stream) < 0) return NULL;
  void *ptr = NULL;
  cp_clear_error();
  cp_history_set_context(cpy_stack_capture());
  int rc = cp_alloc(self->pool, size, (cp_stream_t)stream, &ptr);
  cp_history_set_context(0);
  if (rc != CP_OK) return raise_status(op, rc);
  /* Memory another stream's queued work still touches must not be handed out: a fault. */
  if (ptr != NULL && size > 0) (void)cp_sim_check_handoff(self->sim, (cp_stream_t)stream, (uintptr_t)ptr, size);
  return cpy_from_ptr(ptr);
}

/* launch(ptr, stream=0, size=None): work queued on `stream` over a live allocation (Note
 * [Simulated asynchrony] in backend/sim.h). Memory the pool has not handed out is a fault. */
static PyObject *Pool_launch(PyObject *op, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"ptr", "stream", "size", NULL};
  PyObject *ptr_obj = NULL, *stream_obj = NULL, *size_obj = Py_None;
  SIM_ONLY(op, self, "launch()");
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|OO:launch", kwlist, &ptr_obj, &stream_obj, &size_obj)) return NULL;
  uintptr_t ptr, stream = 0;
  size_t size = 0, live_size = 0;
  if (cpy_as_uintptr(ptr_obj, "ptr", &ptr) < 0) return NULL;
  if (stream_obj != NULL && cpy_as_uintptr(stream_obj, "stream", &stream) < 0) return NULL;
  if (size_obj != Py_None && cpy_as_size(size_obj, "size", &size) < 0) return NULL;
  const int whole = cp_pool_lookup(self->pool, (void *)ptr, &live_size);
  if (size_obj == Py_None) size = whole ? live_size : 1;
  if (size == 0) return PyErr_Format(PyExc_ValueError, "launch(): size must be > 0");
  if (!whole && cp_pool_base_of(self->pool, (void *)ptr, NULL, NULL) != CP_PTR_LIVE) {
    cp_sim_note_fault(self->sim, "launch on memory the pool has not handed out (freed, or never allocated)", ptr, size,
                      (cp_stream_t)stream);
    Py_RETURN_NONE; /* a GPU does not refuse the launch: the kernel faults later */
  }
  cp_clear_error();
  const int rc = cp_sim_launch(self->sim, (cp_stream_t)stream, ptr, size);
  if (rc != CP_OK && rc != CP_ERR_INVALID) return raise_status(op, rc); /* INVALID: counted as a fault */
  Py_RETURN_NONE;
}

/* [{"what", "call", "addr", "size", "stream"}, ...]: the device faults kept so far. */
static PyObject *Pool_device_faults(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  SIM_ONLY(op, self, "device_faults()");
  const uint64_t n = cp_sim_device_faults(self->sim);
  PyObject *list = PyList_New(0);
  for (size_t i = 0; list != NULL && i < n; i++) {
    cp_sim_device_fault_t f;
    if (cp_sim_device_fault(self->sim, i, &f) != CP_OK) break; /* past the kept ones */
    PyObject *d =
        Py_BuildValue("{s:s,s:s,s:K,s:n,s:K}", "what", f.what, "call", f.call, "addr", (unsigned long long)f.addr,
                      "size", (Py_ssize_t)f.size, "stream", (unsigned long long)f.stream);
    if (d == NULL || PyList_Append(list, d) < 0) {
      Py_XDECREF(d);
      Py_CLEAR(list);
      break;
    }
    Py_DECREF(d);
  }
  return list;
}

static PyObject *Pool_device_fault_count(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  SIM_ONLY(op, self, "device_fault_count()");
  return PyLong_FromUnsignedLongLong((unsigned long long)cp_sim_device_faults(self->sim));
}

static PyObject *Pool_clear_device_faults(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  SIM_ONLY(op, self, "clear_device_faults()");
  cp_sim_clear_device_faults(self->sim);
  Py_RETURN_NONE;
}

static PyObject *Pool_set_lag(PyObject *op, PyObject *n_obj) {
  SIM_ONLY(op, self, "set_lag()");
  size_t n = SIZE_MAX;
  if (n_obj != Py_None && cpy_as_size(n_obj, "lag", &n) < 0) return NULL;
  cp_sim_set_lag(self->sim, n == SIZE_MAX ? UINT64_MAX : (uint64_t)n);
  Py_RETURN_NONE;
}

static PyObject *Pool_free(PyObject *op, PyObject *ptr_obj) {
  SIM_ONLY(op, self, "free()");
  uintptr_t ptr;
  if (cpy_as_uintptr(ptr_obj, "ptr", &ptr) < 0) return NULL;
  cp_clear_error();
  cp_history_set_context(ptr != 0 ? cpy_stack_capture() : 0);
  int rc = cp_free(self->pool, (void *)ptr);
  cp_history_set_context(0);
  if (rc != CP_OK) return raise_status(op, rc);
  Py_RETURN_NONE;
}

static PyObject *Pool_record_stream(PyObject *op, PyObject *args) {
  PyObject *ptr_obj;
  PyObject *stream_obj;
  SIM_ONLY(op, self, "record_stream()");
  if (!PyArg_ParseTuple(args, "OO:record_stream", &ptr_obj, &stream_obj)) return NULL;
  uintptr_t ptr;
  uintptr_t stream;
  if (cpy_as_uintptr(ptr_obj, "ptr", &ptr) < 0) return NULL;
  if (cpy_as_uintptr(stream_obj, "stream", &stream) < 0) return NULL;
  cp_clear_error();
  int rc = cp_record_stream(self->pool, (void *)ptr, (cp_stream_t)stream);
  if (rc != CP_OK) return raise_status(op, rc);
  Py_RETURN_NONE;
}

static PyObject *Pool_set_event_log(PyObject *op, PyObject *n_obj) {
  SIM_ONLY(op, self, "set_event_log()");
  size_t n;
  if (cpy_as_size(n_obj, "capacity", &n) < 0) return NULL;
  cp_clear_error();
  int rc = cp_pool_set_event_log(self->pool, n);
  if (rc != CP_OK) return raise_status(op, rc);
  Py_RETURN_NONE;
}

static PyObject *Pool_set_memory_cap(PyObject *op, PyObject *bytes_obj) {
  SIM_ONLY(op, self, "set_memory_cap()");
  size_t bytes;
  if (cpy_as_size(bytes_obj, "bytes", &bytes) < 0) return NULL;
  cp_clear_error();
  int rc = cp_pool_set_memory_cap(self->pool, bytes);
  if (rc != CP_OK) return raise_status(op, rc);
  Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------------------------
 * Simulated pools only: the simulated device
 * ---------------------------------------------------------------------------------------- */

static PyObject *Pool_complete(PyObject *op, PyObject *stream_obj) {
  SIM_ONLY(op, self, "complete()");
  uintptr_t stream;
  if (cpy_as_uintptr(stream_obj, "stream", &stream) < 0) return NULL;
  cp_sim_complete(self->sim, (cp_stream_t)stream);
  Py_RETURN_NONE;
}

static PyObject *Pool_complete_all(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  SIM_ONLY(op, self, "complete_all()");
  cp_sim_complete_all(self->sim);
  Py_RETURN_NONE;
}

/* {call kind name: figure} of a simulated device, one figure per call kind. */
static PyObject *sim_call_dict(const cp_sim_t *sim, uint64_t (*figure)(const cp_sim_t *, cp_sim_call_t)) {
  PyObject *d = PyDict_New();
  if (d == NULL) return NULL;
  for (int i = 0; i < (int)CP_SIM_CALL_COUNT; i++) {
    cp_sim_call_t kind = (cp_sim_call_t)i;
    PyObject *v = PyLong_FromUnsignedLongLong((unsigned long long)figure(sim, kind));
    if (v == NULL || PyDict_SetItemString(d, cp_sim_call_name(kind), v) < 0) {
      Py_XDECREF(v);
      Py_DECREF(d);
      return NULL;
    }
    Py_DECREF(v);
  }
  return d;
}

static PyObject *Pool_backend_calls(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  SIM_ONLY(op, self, "backend_calls()");
  return sim_call_dict(self->sim, cp_sim_calls);
}

static PyObject *Pool_backend_bytes(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  SIM_ONLY(op, self, "backend_bytes()");
  return sim_call_dict(self->sim, cp_sim_call_bytes);
}

static PyObject *Pool_fail_nth(PyObject *op, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"kind", "n", "oom", NULL};
  const char *kind_name = NULL;
  PyObject *n_obj = NULL;
  int oom = 1;
  SIM_ONLY(op, self, "fail_nth()");
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "sO|p:fail_nth", kwlist, &kind_name, &n_obj, &oom)) return NULL;
  cp_sim_call_t found = CP_SIM_RESERVE;
  if (cpy_parse_call_kind(kind_name, &found) < 0) return NULL;
  unsigned long long n;
  if (cpy_as_unsigned(n_obj, "n", UINT64_MAX, &n) < 0) return NULL;
  cp_sim_fail_nth(self->sim, found, (uint64_t)n, oom ? CP_ERR_OOM : CP_ERR_BACKEND);
  Py_RETURN_NONE;
}

static PyObject *Pool_sim_reserved_bytes(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  SIM_ONLY(op, self, "sim_reserved_bytes()");
  return cpy_from_size(cp_sim_reserved_bytes(self->sim));
}

static PyObject *Pool_sim_live_reservations(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  SIM_ONLY(op, self, "sim_live_reservations()");
  return cpy_from_size(cp_sim_live_reservations(self->sim));
}

static PyObject *Pool_sim_live_events(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  SIM_ONLY(op, self, "sim_live_events()");
  return cpy_from_size(cp_sim_live_events(self->sim));
}

static PyObject *Pool_invalidate_stream(PyObject *op, PyObject *stream_obj) {
  SIM_ONLY(op, self, "invalidate_stream()");
  uintptr_t stream;
  if (cpy_as_uintptr(stream_obj, "stream", &stream) < 0) return NULL;
  cp_clear_error();
  int rc = cp_sim_invalidate_stream(self->sim, (cp_stream_t)stream);
  if (rc != CP_OK) return raise_status(op, rc);
  Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------------------------
 * Simulated pools only: replay of traces
 * ---------------------------------------------------------------------------------------- */

/* The replay's last use of a block before its free: a launch on the simulated device, which
 * runs it behind the host (set_lag), so that memory given back too early is a device fault. */
static void replay_use(void *arg, uintptr_t ptr, size_t size, cp_stream_t stream) {
  (void)cp_sim_queue(arg, stream, ptr, size); /* a live block of the pool: no lookup needed */
}

static PyObject *Pool_replay_start(PyObject *op, PyObject *args) {
  SIM_ONLY(op, self, "replay_start()");
  int device = -1;
  if (!PyArg_ParseTuple(args, "|i:replay_start", &device)) return NULL;
  if (self->replay != NULL) {
    PyErr_SetString(PyExc_RuntimeError, "a replay is already under way on this pool");
    return NULL;
  }
  cp_clear_error();
  int rc = cp_replay_create(self->pool, device, &self->replay);
  if (rc != CP_OK) return raise_status(op, rc);
  cp_replay_set_use(self->replay, replay_use, self->sim);
  Py_RETURN_NONE;
}

static int require_replay(PoolObject *self, const char *what) {
  if (require_sim(self, what) < 0) return -1;
  if (self->replay == NULL) {
    PyErr_SetString(PyExc_RuntimeError, "no replay under way (call replay_start first)");
    return -1;
  }
  return 0;
}

/* replay_feed(buffer, start=0, count=-1) -> bool: events [start, start + count) of a buffer
 * of 40-byte records. False once an allocation failed (see replay_result). */
static PyObject *Pool_replay_feed(PyObject *op, PyObject *args) {
  PoolObject *self = (PoolObject *)op;
  if (require_replay(self, "replay_feed()") < 0) return NULL;
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
  if (rc != CP_OK) return raise_status(op, rc);
  Py_RETURN_TRUE;
}

static PyObject *Pool_replay_result(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  PoolObject *self = (PoolObject *)op;
  if (require_replay(self, "replay_result()") < 0) return NULL;
  cp_replay_result_t r;
  cp_replay_result(self->replay, &r);
  return Py_BuildValue("{s:K,s:K,s:K,s:K,s:K,s:K,s:n,s:n,s:n,s:n,s:n,s:K,s:K,s:O,s:K,s:K,s:K}", "events",
                       (unsigned long long)r.events, "allocs", (unsigned long long)r.allocs, "frees",
                       (unsigned long long)r.frees, "skipped", (unsigned long long)r.skipped, "bad_events",
                       (unsigned long long)r.bad_events, "releases", (unsigned long long)r.releases, "peak_allocated",
                       (Py_ssize_t)r.peak_allocated, "peak_requested", (Py_ssize_t)r.peak_requested, "peak_reserved",
                       (Py_ssize_t)r.peak_reserved, "cached_free_at_peak", (Py_ssize_t)r.cached_free_at_peak,
                       "largest_free_at_peak", (Py_ssize_t)r.largest_free_at_peak, "device_allocs",
                       (unsigned long long)r.device_allocs, "device_frees", (unsigned long long)r.device_frees, "oom",
                       r.oom ? Py_True : Py_False, "oom_event", (unsigned long long)r.oom_event, "oom_size",
                       (unsigned long long)r.oom_size, "ns", (unsigned long long)r.ns);
}

static PyObject *Pool_replay_window(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  PoolObject *self = (PoolObject *)op;
  if (require_replay(self, "replay_window()") < 0) return NULL;
  size_t a, r;
  cp_replay_window(self->replay, &a, &r);
  return Py_BuildValue("(nn)", (Py_ssize_t)a, (Py_ssize_t)r);
}

/* replay_seed_segment(stream, kind, size, blocks): memory live before the trace's first
 * event (cp_replay_seed_segment); kind "small" or "large", blocks (id, offset, size, requested). */
static PyObject *Pool_replay_seed_segment(PyObject *op, PyObject *args) {
  PoolObject *self = (PoolObject *)op;
  if (require_replay(self, "replay_seed_segment()") < 0) return NULL;
  PyObject *stream_obj, *size_obj, *blocks_obj;
  const char *kind_name;
  if (!PyArg_ParseTuple(args, "OsOO:replay_seed_segment", &stream_obj, &kind_name, &size_obj, &blocks_obj)) return NULL;
  int kind = strcmp(kind_name, "small") == 0 ? CP_KIND_SMALL : strcmp(kind_name, "large") == 0 ? CP_KIND_LARGE : -1;
  uintptr_t stream;
  size_t size, n;
  cp_seed_block_t *blocks;
  if (kind < 0)
    return PyErr_Format(PyExc_ValueError, "kind must be 'small' or 'large', not %R", PyTuple_GET_ITEM(args, 1));
  if (cpy_as_uintptr(stream_obj, "stream", &stream) < 0 || cpy_as_size(size_obj, "segment size", &size) < 0)
    return NULL;
  if (cpy_parse_seed_blocks(blocks_obj, &blocks, &n) < 0) return NULL;
  cp_clear_error();
  int rc = cp_replay_seed_segment(self->replay, (cp_stream_t)stream, kind, size, blocks, n);
  PyMem_Free(blocks);
  if (rc != CP_OK) return raise_status(op, rc);
  Py_RETURN_NONE;
}

/* End the replay: every allocation still live is freed. */
static PyObject *Pool_replay_stop(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  PoolObject *self = (PoolObject *)op;
  if (require_replay(self, "replay_stop()") < 0) return NULL;
  cp_replay_destroy(self->replay);
  self->replay = NULL;
  Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------------------------
 * The type
 * ---------------------------------------------------------------------------------------- */

static PyMethodDef Pool_methods[] = {
    /* either kind */
    {"stats", Pool_stats, METH_NOARGS, "The statistics, keyed by the built-in allocator's names."},
    {"info", Pool_info, METH_NOARGS,
     "Facts beyond the statistics: reserved, allocated, cached_free, largest_free_block,..."},
    {"reset_peak_stats", Pool_reset_peak_stats, METH_NOARGS, "Set every peak to its current."},
    {"reset_accumulated_stats", Pool_reset_accumulated_stats, METH_NOARGS,
     "Zero the accumulated statistics and counters."},
    {"check", Pool_check, METH_NOARGS,
     "Walk the pool and count invariant violations, and on a simulated device the device faults (0 = healthy)."},
    {"check_report", Pool_check_report, METH_NOARGS, "The invariant violations, one per line (\"\" when healthy)."},
    {"oom_report", Pool_oom_report, METH_O,
     "oom_report(size) -> str\n\nThe out-of-memory report for a request of size bytes."},
    {"snapshot", Pool_snapshot, METH_NOARGS,
     "Every segment, by address: dicts of address, size, mapped, stream, kind ('small'/'large'), page_mapped and "
     "blocks [(address, size, requested, state)], state one of free, live, pending, unmapped, mapping, unmapping."},
    {"history", Pool_history, METH_NOARGS,
     "history() -> (records, recorded, capacity)\n\nThe history held, oldest first: (seq, time_ns, action, addr, "
     "size, stream, stack_id) tuples; recorded counts every record ever made, capacity is the ring's size."},
    {"last_oom", Pool_last_oom, METH_NOARGS,
     "The figures of the pool's latest out-of-memory failure (dict, with its \"report\" text), or None."},
    {"event_log", Pool_event_log, METH_NOARGS,
     "The event log and the live blocks, read together: {\"capacity\", \"first\", \"next\", \"events\", "
     "\"live\"}, the last two packed 40-byte trace records."},
    {"config", Pool_config, METH_NOARGS, "The configuration the pool runs with, in \"key:value,...\" form."},
    {"empty_cache", Pool_empty_cache, METH_NOARGS, "Return every wholly free segment to the device."},
    {"set_memory_fraction", Pool_set_memory_fraction, METH_O,
     "set_memory_fraction(fraction)\n\nCap the reserved memory at fraction of the device's capacity."},
    /* simulated pools */
    {"alloc", CPY_METH_KW(Pool_alloc), METH_VARARGS | METH_KEYWORDS,
     "alloc(size, stream=0) -> int\n\nAllocate size bytes for use on stream; returns the address (0 for size 0)."},
    {"free", Pool_free, METH_O, "free(ptr)\n\nFree an address returned by alloc (0 is a no-op)."},
    {"record_stream", Pool_record_stream, METH_VARARGS,
     "record_stream(ptr, stream)\n\nMark ptr as used on stream too: it is reused only after that work ends."},
    {"set_history", Pool_set_history, METH_O,
     "set_history(max_entries)\n\nRecord the last max_entries events (0: stop and drop them)."},
    {"set_event_log", Pool_set_event_log, METH_O,
     "set_event_log(capacity)\n\nKeep the latest capacity allocation events (rounded up to a power of two; 0: "
     "none, the default for a simulated pool)."},
    {"set_memory_cap", Pool_set_memory_cap, METH_O,
     "set_memory_cap(bytes)\n\nCap the reserved memory at bytes (0 = no cap)."},
    {"complete", Pool_complete, METH_O, "complete(stream)\n\nFinish all work submitted to stream so far."},
    {"complete_all", Pool_complete_all, METH_NOARGS, "Finish all work on every stream."},
    {"launch", CPY_METH_KW(Pool_launch), METH_VARARGS | METH_KEYWORDS,
     "launch(ptr, stream=0, size=None)\n\nQueue work on stream that uses the live allocation at ptr (its whole "
     "size by default); it completes with complete(stream) or a call that waits for the device. Memory the pool "
     "has not handed out is a device fault."},
    {"device_faults", Pool_device_faults, METH_NOARGS,
     "What a GPU would have faulted on so far: a list of dicts (what, call, addr, size, stream); [] when none."},
    {"device_fault_count", Pool_device_fault_count, METH_NOARGS,
     "Device faults so far, all of them (device_faults() lists the first 64)."},
    {"clear_device_faults", Pool_clear_device_faults, METH_NOARGS, "Forget the device faults so far."},
    {"set_lag", Pool_set_lag, METH_O,
     "set_lag(n)\n\nLaunches a stream may run behind before its oldest completes on its own: 0 is a device that "
     "is always idle, None only when told."},
    {"backend_calls", Pool_backend_calls, METH_NOARGS, "Calls made to the simulated device so far, by kind."},
    {"backend_bytes", Pool_backend_bytes, METH_NOARGS,
     "Bytes named by the calls made to the simulated device so far, by kind (0 for kinds without a size)."},
    {"fail_nth", CPY_METH_KW(Pool_fail_nth), METH_VARARGS | METH_KEYWORDS,
     "fail_nth(kind, n, oom=True)\n\nMake the n-th next backend call of kind (\"reserve\", ...) fail: out of "
     "memory, or a device error when oom is False. n = 0 disarms."},
    {"sim_reserved_bytes", Pool_sim_reserved_bytes, METH_NOARGS,
     "Bytes the simulated device has handed out to the pool."},
    {"sim_live_reservations", Pool_sim_live_reservations, METH_NOARGS, "Reservations live on the simulated device."},
    {"sim_live_events", Pool_sim_live_events, METH_NOARGS, "Events live on the simulated device."},
    {"invalidate_stream", Pool_invalidate_stream, METH_O,
     "invalidate_stream(stream)\n\nMake stream invalid, as a destroyed stream is: recording an event on it "
     "fails from now on, so freeing a block used there (record_stream) raises."},
    {"replay_start", Pool_replay_start, METH_VARARGS,
     "replay_start(device=-1)\n\nBegin replaying a trace into this pool (device -1: all)."},
    {"replay_feed", Pool_replay_feed, METH_VARARGS,
     "replay_feed(buffer, start=0, count=-1) -> bool\n\nReplay 40-byte trace records; False once "
     "an allocation failed."},
    {"replay_seed_segment", Pool_replay_seed_segment, METH_VARARGS,
     "replay_seed_segment(stream, kind, size, blocks)\n\nBefore the first event: reserve one segment of exactly "
     "size bytes for stream ('small' or 'large' pool) with blocks [(id, offset, size, requested), ...] live."},
    {"replay_result", Pool_replay_result, METH_NOARGS, "The replay's figures so far (dict)."},
    {"replay_window", Pool_replay_window, METH_NOARGS, "(max allocated, max reserved) since the previous call."},
    {"replay_stop", Pool_replay_stop, METH_NOARGS, "End the replay, freeing what is still live."},
    {"close", Pool_close, METH_NOARGS,
     "Destroy the pool, then the device. Idempotent; other methods then raise ValueError."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Pool_getset[] = {
    {"closed", Pool_get_closed, NULL, "True once close() has run (never for a device handle).", NULL},
    {"capacity", Pool_get_capacity, NULL, "The simulated device's capacity in bytes.", NULL},
    {"device", Pool_get_device, NULL, "The device a handle names; None for a simulated pool.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(Pool_doc,
             "Pool(capacity, config='', auto_complete=False, touch_memory=True)\n\n"
             "A cudapool pool. Constructed: a pool over a simulated device of capacity bytes, owned\n"
             "by the object; config uses the PYTORCH_CUDA_ALLOC_CONF syntax; auto_complete: events\n"
             "complete as soon as recorded; touch_memory=False: addresses are not backed by host\n"
             "memory. From device_pool(d): a handle of device d's process-wide pool, whose methods\n"
             "that drive a simulated device raise TypeError.");

static PyType_Slot Pool_slots[] = {
    {Py_tp_new, (void *)Pool_new},
    {Py_tp_dealloc, (void *)Pool_dealloc},
    {Py_tp_repr, (void *)Pool_repr},
    {Py_tp_methods, Pool_methods},
    {Py_tp_getset, Pool_getset},
    {Py_tp_doc, (void *)Pool_doc},
    {0, NULL},
};

#ifdef Py_TPFLAGS_IMMUTABLETYPE
#define CPY_TPFLAGS_IMMUTABLE Py_TPFLAGS_IMMUTABLETYPE
#else
#define CPY_TPFLAGS_IMMUTABLE 0
#endif

PyType_Spec cpy_pool_spec = {
    .name = "cudapool._C.Pool",
    .basicsize = sizeof(PoolObject),
    .itemsize = 0,
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | CPY_TPFLAGS_IMMUTABLE, /* Note [Subclassing Pool] */
    .slots = Pool_slots,
};
