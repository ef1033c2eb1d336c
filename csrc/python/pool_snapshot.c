/* pool_snapshot.c — the Pool methods that read what a pool holds and did, of either kind: its
 * snapshot (each segment cut into torch's segments, Note [Torch's segments] in core/snapshot.h)
 * and its history. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

#include "core/snapshot.h"
#include "python/convert.h"
#include "python/pool.h"
#include "python/stacks.h"

static const char *const snap_state_names[] = {"free",    "live",      "pending", "unmapped",
                                               "mapping", "unmapping", "lent",    "draining"};
#define SNAP_STATE_COUNT (sizeof snap_state_names / sizeof snap_state_names[0])

PyObject *cpy_pool_torch_block_states(void) {
  static const char *const torch_names[] = {"inactive", "active_allocated", "active_pending_free"};
  PyObject *states = PyDict_New();
  for (size_t i = 0; states != NULL && i < SNAP_STATE_COUNT; i++) {
    const int t = cp_snapshot_torch_state((int)i);
    PyObject *name = t >= 0 ? PyUnicode_FromString(torch_names[t]) : Py_None;
    if (t < 0) Py_INCREF(name);
    if (name == NULL || PyDict_SetItemString(states, snap_state_names[i], name) < 0) Py_CLEAR(states);
    Py_XDECREF(name);
  }
  return states;
}

/* A segment's runs (Note [Torch's segments] in core/snapshot.h) as (first, count, total_size,
 * allocated_size, active_size, requested_size) tuples, `first` an index into its blocks. */
static PyObject *snapshot_runs(const cp_snapshot_t *snap, const cp_snapshot_segment_t *s) {
  PyObject *runs = PyList_New(0);
  cp_snapshot_run_t r;
  for (size_t pos = 0; runs != NULL && cp_snapshot_next_run(snap, s, &pos, &r);) {
    PyObject *t = Py_BuildValue("(nnKKKK)", (Py_ssize_t)(r.first_block - s->first_block), (Py_ssize_t)r.block_count,
                                (unsigned long long)r.total_size, (unsigned long long)r.allocated_size,
                                (unsigned long long)r.active_size, (unsigned long long)r.requested_size);
    if (t == NULL || PyList_Append(runs, t) < 0) Py_CLEAR(runs);
    Py_XDECREF(t);
  }
  return runs;
}

/* One segment of a snapshot as a dict; its blocks as (addr, size, requested, state) tuples,
 * its runs as snapshot_runs has them. */
static PyObject *snapshot_segment(const cp_snapshot_t *snap, const cp_snapshot_segment_t *s) {
  PyObject *runs = snapshot_runs(snap, s);
  if (runs == NULL) return NULL;
  PyObject *blocks = PyList_New((Py_ssize_t)s->block_count);
  if (blocks == NULL) {
    Py_DECREF(runs);
    return NULL;
  }
  for (size_t k = 0; k < s->block_count; k++) {
    const cp_snapshot_block_t *b = &snap->blocks[s->first_block + k];
    const char *state = b->state >= 0 && (size_t)b->state < SNAP_STATE_COUNT ? snap_state_names[b->state] : "unknown";
    PyObject *t = Py_BuildValue("(KKKs)", (unsigned long long)b->addr, (unsigned long long)b->size,
                                (unsigned long long)b->requested, state);
    if (t == NULL) {
      Py_DECREF(blocks);
      Py_DECREF(runs);
      return NULL;
    }
    PyList_SET_ITEM(blocks, (Py_ssize_t)k, t);
  }
  const char *region = s->tag != 0 ? cp_region_name(s->tag) : NULL;
  return Py_BuildValue("{sKsKsKsKsssOszsKsNsN}", "address", (unsigned long long)s->addr, "size",
                       (unsigned long long)s->size, "mapped", (unsigned long long)s->mapped, "stream",
                       (unsigned long long)s->stream, "kind", s->kind == CP_KIND_SMALL ? "small" : "large",
                       "page_mapped", s->page_mapped ? Py_True : Py_False, "region", region, "paused",
                       (unsigned long long)s->paused, "blocks", blocks, "runs", runs);
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
    return cpy_pool_raise_status(op, rc);
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
  if (rc != CP_OK) return cpy_pool_raise_status(op, rc);
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

/* pool.h */
PyMethodDef cpy_pool_snapshot_methods[] = {
    {"snapshot", Pool_snapshot, METH_NOARGS,
     "Every segment, by address: dicts of address, size, mapped, stream, kind ('small'/'large'), page_mapped, "
     "region (its tag, or None), paused (bytes given back by a pause) and "
     "blocks [(address, size, requested, state)], state one of free, live, pending, unmapped, mapping, unmapping, "
     "lent, draining (TORCH_BLOCK_STATES: torch's for each), and runs [(first, count, total_size, allocated_size, "
     "active_size, requested_size)]: the segment cut into torch's segments, blocks[first:first + count] each."},
    {"history", Pool_history, METH_NOARGS,
     "history() -> (records, recorded, capacity)\n\nThe history held, oldest first: (seq, time_ns, action, addr, "
     "size, stream, stack_id) tuples; recorded counts every record ever made, capacity is the ring's size."},
    {"set_history", Pool_set_history, METH_O,
     "set_history(max_entries)\n\nRecord the last max_entries events (0: stop and drop them)."},
    {NULL, NULL, 0, NULL},
};
