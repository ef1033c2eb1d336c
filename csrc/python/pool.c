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
#include "devices/abi.h"
#include "devices/devices.h"
#include "python/convert.h"
#include "python/pool.h"

/* ------------------------------------------------------------------------------------------
 * Kinds, state and errors
 * ---------------------------------------------------------------------------------------- */

PyObject *cpy_pool_raise_status(PyObject *op, int status) {
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

int cpy_pool_require_sim(PoolObject *self, const char *what) {
  if (self->device >= 0) {
    PyErr_Format(PyExc_TypeError, "%s needs a simulated pool; this Pool is a handle of device %d's pool", what,
                 self->device);
    return -1;
  }
  return check_open(self);
}

/* pool.h */
int cpy_pool_resolve(PoolObject *self, cp_pool_t **out) {
  if (check_open(self) < 0) return -1;
  *out = self->device >= 0 ? cpd_pool_if_created(self->device) : self->pool;
  return 0;
}

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
    (void)cpy_pool_require_sim(self, "close()");
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
    (void)cpy_pool_require_sim(self, "capacity");
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

typedef struct oom_report_arg_s {
  cp_pool_t *pool;
  size_t size;
} oom_report_arg_t;

static int oom_report_format(const void *arg, char *buf, size_t size) {
  const oom_report_arg_t *a = arg;
  return cp_pool_oom_report(a->pool, a->size, buf, size);
}

static PyObject *Pool_oom_report(PyObject *op, PyObject *size_obj) {
  ANY_POOL(op, self, pool);
  size_t size;
  if (cpy_as_size(size_obj, "size", &size) < 0) return NULL;
  if (pool == NULL) return PyUnicode_FromString("");
  const oom_report_arg_t arg = {pool, size};
  return cpy_formatted(oom_report_format, &arg, "cp_pool_oom_report");
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
    if (rc != CP_OK) return cpy_pool_raise_status(op, rc);
  }
  /* An empty array may be NULL, which y# would turn into None: bytes always ("" when empty). */
  PyObject *r = Py_BuildValue(
      "{s:n,s:K,s:K,s:y#,s:y#}", "capacity", (Py_ssize_t)log.capacity, "first", (unsigned long long)log.first, "next",
      (unsigned long long)log.next, "events", log.events != NULL ? (const char *)log.events : "",
      (Py_ssize_t)(log.n_events * sizeof(cp_trace_event_t)), "live", log.live != NULL ? (const char *)log.live : "",
      (Py_ssize_t)(log.n_live * sizeof(cp_trace_event_t)));
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
  if (rc != CP_OK) return cpy_pool_raise_status(op, rc);
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
  if (rc != CP_OK) return cpy_pool_raise_status(op, rc);
  Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------------------------
 * Regions: pause, resume and what each holds (core/pause.c)
 * ---------------------------------------------------------------------------------------- */

/* The region id of `tag` (None: 0, every region); -1 with an exception set. */
static int region_of(PyObject *tag, uint32_t *out) {
  *out = 0;
  if (tag == NULL || tag == Py_None) return 0;
  const char *name = PyUnicode_Check(tag) ? PyUnicode_AsUTF8(tag) : NULL;
  if (name == NULL) {
    if (!PyErr_Occurred())
      PyErr_Format(PyExc_TypeError, "a region's tag is a str or None, not %s", Py_TYPE(tag)->tp_name);
    return -1;
  }
  if (cp_region_id(name, out) != CP_OK) {
    PyErr_SetString(PyExc_ValueError, cp_last_error());
    return -1;
  }
  return 0;
}

/* Pause and resume may wait for device work and copy gigabytes: without the GIL on a device
 * pool (Note [GIL]); a simulated pool's device never blocks the host. */
static PyObject *Pool_pause(PyObject *op, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"tag", "backup", NULL};
  PyObject *tag = Py_None;
  int backup = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "|Op:pause", kwlist, &tag, &backup)) return NULL;
  ANY_POOL(op, self, pool);
  uint32_t id = 0;
  if (region_of(tag, &id) < 0) return NULL;
  if (pool == NULL) Py_RETURN_NONE; /* a device without a pool holds no region */
  int rc;
  cp_clear_error();
  if (self->device >= 0) {
    Py_BEGIN_ALLOW_THREADS rc = cp_pool_pause(pool, id, backup ? CP_PAUSE_BACKUP : 0);
    Py_END_ALLOW_THREADS
  } else {
    rc = cp_pool_pause(pool, id, backup ? CP_PAUSE_BACKUP : 0);
  }
  if (rc != CP_OK) return cpy_pool_raise_status(op, rc);
  Py_RETURN_NONE;
}

static PyObject *Pool_resume(PyObject *op, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"tag", NULL};
  PyObject *tag = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O:resume", kwlist, &tag)) return NULL;
  ANY_POOL(op, self, pool);
  uint32_t id = 0;
  if (region_of(tag, &id) < 0) return NULL;
  if (pool == NULL) Py_RETURN_NONE;
  int rc;
  cp_clear_error();
  if (self->device >= 0) {
    Py_BEGIN_ALLOW_THREADS rc = cp_pool_resume(pool, id);
    Py_END_ALLOW_THREADS
  } else {
    rc = cp_pool_resume(pool, id);
  }
  if (rc != CP_OK) return cpy_pool_raise_status(op, rc);
  Py_RETURN_NONE;
}

static PyObject *Pool_regions(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  ANY_POOL(op, self, pool);
  (void)self;
  PyObject *list = PyList_New(0);
  if (list == NULL || pool == NULL) return list;
  cp_region_info_t infos[CP_REGION_MAX];
  size_t n = cp_pool_regions(pool, infos, CP_REGION_MAX);
  if (n > CP_REGION_MAX) n = CP_REGION_MAX;
  for (size_t i = 0; i < n; i++) {
    const cp_region_info_t *r = &infos[i];
    const char *name = cp_region_name(r->tag);
    PyObject *d = Py_BuildValue("{sssOsKsKsKsKsKsKsK}", "tag", name != NULL ? name : "?", "paused",
                                r->paused ? Py_True : Py_False, "live_bytes", (unsigned long long)r->live_bytes,
                                "live_blocks", (unsigned long long)r->live_blocks, "reserved_bytes",
                                (unsigned long long)r->reserved, "paused_bytes", (unsigned long long)r->paused_bytes,
                                "backup_bytes", (unsigned long long)r->backup_bytes, "segments",
                                (unsigned long long)r->segments, "streams", (unsigned long long)r->streams);
    if (d == NULL || PyList_Append(list, d) < 0) {
      Py_XDECREF(d);
      Py_DECREF(list);
      return NULL;
    }
    Py_DECREF(d);
  }
  return list;
}

/* ------------------------------------------------------------------------------------------
 * The type
 * ---------------------------------------------------------------------------------------- */

static PyMethodDef Pool_common_methods[] = {
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
    {"last_oom", Pool_last_oom, METH_NOARGS,
     "The figures of the pool's latest out-of-memory failure (dict, with its \"report\" text), or None."},
    {"event_log", Pool_event_log, METH_NOARGS,
     "The event log and the live blocks, read together: {\"capacity\", \"first\", \"next\", \"events\", "
     "\"live\"}, the last two packed 40-byte trace records."},
    {"config", Pool_config, METH_NOARGS, "The configuration the pool runs with, in \"key:value,...\" form."},
    {"empty_cache", Pool_empty_cache, METH_NOARGS, "Return every wholly free segment to the device."},
    {"set_memory_fraction", Pool_set_memory_fraction, METH_O,
     "set_memory_fraction(fraction)\n\nCap the reserved memory at fraction of the device's capacity."},
    {"pause", CPY_METH_KW(Pool_pause), METH_VARARGS | METH_KEYWORDS,
     "pause(tag=None, backup=False)\n\nGive back the memory of region tag (None: every region), live blocks "
     "included, keeping their addresses; backup copies their bytes to host memory first."},
    {"resume", CPY_METH_KW(Pool_resume), METH_VARARGS | METH_KEYWORDS,
     "resume(tag=None)\n\nMap memory again at every address of region tag (None: every paused region) and copy "
     "the backups back."},
    {"regions", Pool_regions, METH_NOARGS,
     "The regions of this pool: dicts of tag, paused, live_bytes, live_blocks, reserved_bytes, paused_bytes, "
     "backup_bytes, segments and streams."},
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

/* Both tables, joined once (cpy_pool_spec_prepare) before the type is made. */
#define POOL_METHODS_MAX 96
static PyMethodDef Pool_methods[POOL_METHODS_MAX];

int cpy_pool_spec_prepare(void) {
  size_t n = 0;
  for (const PyMethodDef *m = Pool_common_methods; m->ml_name != NULL; m++) Pool_methods[n++] = *m;
  const PyMethodDef *const more[] = {cpy_pool_snapshot_methods, cpy_pool_sim_methods};
  for (size_t t = 0; t < sizeof more / sizeof more[0]; t++) {
    for (const PyMethodDef *m = more[t]; m->ml_name != NULL; m++) {
      if (n + 1 >= POOL_METHODS_MAX) {
        PyErr_SetString(PyExc_SystemError, "cudapool._C.Pool: more methods than POOL_METHODS_MAX");
        return -1;
      }
      Pool_methods[n++] = *m;
    }
  }
  Pool_methods[n] = (PyMethodDef){NULL, NULL, 0, NULL};
  return 0;
}

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
