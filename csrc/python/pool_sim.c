/* pool_sim.c — the methods of cudapool._C.Pool that drive a simulated pool (Note [Pool
 * handles], pool.c): allocation and the cap, the simulated device's controls and faults, and
 * the replay of traces. Each raises TypeError on a device handle. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/snapshot.h"
#include "python/convert.h"
#include "python/pool.h"
#include "python/stacks.h"

#define raise_status cpy_pool_raise_status

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
  int rc = cp_alloc_in(self->pool, size, (cp_stream_t)stream, cp_region_of_thread(), &ptr);
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
  if (cpy_pool_require_sim(self, what) < 0) return -1;
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
 * The table
 * ---------------------------------------------------------------------------------------- */

PyMethodDef cpy_pool_sim_methods[] = {
    {"alloc", CPY_METH_KW(Pool_alloc), METH_VARARGS | METH_KEYWORDS,
     "alloc(size, stream=0) -> int\n\nAllocate size bytes for use on stream; returns the address (0 for size 0)."},
    {"free", Pool_free, METH_O, "free(ptr)\n\nFree an address returned by alloc (0 is a no-op)."},
    {"record_stream", Pool_record_stream, METH_VARARGS,
     "record_stream(ptr, stream)\n\nMark ptr as used on stream too: it is reused only after that work ends."},
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
    {NULL, NULL, 0, NULL},
};
