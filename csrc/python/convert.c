/* convert.c — conversions between Python objects and the core's values, and the mapping of
 * status codes to Python exceptions (see convert.h). */
#include "python/convert.h"

#include <stdio.h>
#include <string.h>

/* ------------------------------------------------------------------------------------------
 * Errors
 * ---------------------------------------------------------------------------------------- */

PyObject *cpy_raise_status(PyObject *oom_error, int status) {
  const char *msg = cp_last_error();
  if (msg == NULL || msg[0] == '\0') msg = cp_status_name(status);
  switch (status) {
    case CP_ERR_OOM: PyErr_SetString(oom_error, msg); break;
    case CP_ERR_INVALID: PyErr_SetString(PyExc_ValueError, msg); break;
    case CP_ERR_HOST_OOM: PyErr_SetString(PyExc_MemoryError, msg); break;
    default: PyErr_Format(PyExc_RuntimeError, "%s: %s", cp_status_name(status), msg); break;
  }
  return NULL;
}

/* ------------------------------------------------------------------------------------------
 * Python -> C
 * ---------------------------------------------------------------------------------------- */

int cpy_as_unsigned(PyObject *obj, const char *what, unsigned long long max, unsigned long long *out) {
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

int cpy_as_size(PyObject *obj, const char *what, size_t *out) {
  unsigned long long v;
  if (cpy_as_unsigned(obj, what, (unsigned long long)SIZE_MAX, &v) < 0) return -1;
  *out = (size_t)v;
  return 0;
}

int cpy_parse_seed_blocks(PyObject *seq_obj, cp_seed_block_t **out, size_t *out_n) {
  PyObject *seq = PySequence_Fast(seq_obj, "seed blocks must be a sequence of (id, offset, size, requested)");
  if (seq == NULL) return -1;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  cp_seed_block_t *blocks = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof *blocks);
  if (blocks == NULL) {
    Py_DECREF(seq);
    PyErr_NoMemory();
    return -1;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
    unsigned long long id;
    int ok = PyTuple_Check(item) && PyTuple_GET_SIZE(item) == 4;
    if (!ok) PyErr_Format(PyExc_TypeError, "seed block %zd must be a tuple (id, offset, size, requested)", i);
    if (!ok || cpy_as_unsigned(PyTuple_GET_ITEM(item, 0), "seed block id", UINT64_MAX, &id) < 0 ||
        cpy_as_size(PyTuple_GET_ITEM(item, 1), "seed block offset", &blocks[i].offset) < 0 ||
        cpy_as_size(PyTuple_GET_ITEM(item, 2), "seed block size", &blocks[i].size) < 0 ||
        cpy_as_size(PyTuple_GET_ITEM(item, 3), "seed block requested", &blocks[i].requested) < 0) {
      PyMem_Free(blocks);
      Py_DECREF(seq);
      return -1;
    }
    blocks[i].id = (uint64_t)id;
  }
  Py_DECREF(seq);
  *out = blocks;
  *out_n = (size_t)n;
  return 0;
}

int cpy_as_uintptr(PyObject *obj, const char *what, uintptr_t *out) {
  unsigned long long v;
  if (cpy_as_unsigned(obj, what, (unsigned long long)UINTPTR_MAX, &v) < 0) return -1;
  *out = (uintptr_t)v;
  return 0;
}

int cpy_parse_device(PyObject *obj, int *out) {
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

int cpy_parse_call_kind(const char *kind_name, cp_sim_call_t *out) {
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

/* ------------------------------------------------------------------------------------------
 * C -> Python
 * ---------------------------------------------------------------------------------------- */

PyObject *cpy_from_size(size_t value) { return PyLong_FromSize_t(value); }

PyObject *cpy_from_ptr(const void *ptr) { return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)ptr); }

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

PyObject *cpy_str_tuple(const char *const *names, size_t n) {
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

const char *const cpy_stat_metric_names[4] = {"current", "peak", "allocated", "freed"};

static int stats_put(PyObject *dict, const char *prefix, const cp_stat_t *stat) {
  const int64_t values[4] = {stat->current, stat->peak, stat->allocated, stat->freed};
  char key[160];
  for (size_t m = 0; m < 4; m++) {
    snprintf(key, sizeof key, "%s.%s", prefix, cpy_stat_metric_names[m]);
    if (dict_set_i64(dict, key, values[m]) < 0) return -1;
  }
  return 0;
}

PyObject *cpy_stats_to_dict(const cp_stats_t *stats_in) {
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
  X(device_total)              \
  X(page_mapped)               \
  X(page_segments)             \
  X(address_space)             \
  X(device_map)                \
  X(device_unmap)              \
  X(stitched_ranges)           \
  X(stitched_space)            \
  X(stitches)                  \
  X(stitch_reuses)             \
  X(paused_bytes)              \
  X(backup_bytes)              \
  X(plan_state)                \
  X(plan_bytes)                \
  X(plan_step_allocs)          \
  X(plan_planned)              \
  X(plans)                     \
  X(plan_drops)                \
  X(plan_served)               \
  X(plan_missed)               \
  X(plan_us)

PyObject *cpy_info_to_dict(const cp_pool_info_t *info) {
  PyObject *d = PyDict_New();
  if (d == NULL) return NULL;
#define CP_X(field) \
  if (dict_set_u64(d, #field, (unsigned long long)info->field) < 0) goto fail;
  CP_POOL_INFO_FIELDS(CP_X)
#undef CP_X
  return d;
fail:
  Py_DECREF(d);
  return NULL;
}

/* {"stream", "cached_free", ...} of one stream's share. */
static PyObject *oom_stream_to_dict(const cp_oom_stream_t *s) {
  return Py_BuildValue("{s:K,s:n,s:n,s:n,s:n,s:n}", "stream", (unsigned long long)s->stream, "cached_free",
                       (Py_ssize_t)s->cached_free, "free_blocks", (Py_ssize_t)s->free_blocks, "largest_free_block",
                       (Py_ssize_t)s->largest_free_block, "pending_free", (Py_ssize_t)s->pending_free, "pending_blocks",
                       (Py_ssize_t)s->pending_blocks);
}

static int oom_format(const void *in, char *buf, size_t size) { return cp_oom_format(in, buf, size); }

PyObject *cpy_oom_to_dict(const cp_oom_info_t *in) {
  PyObject *report = cpy_formatted(oom_format, in, "cp_oom_format");
  if (report == NULL) return NULL;
  PyObject *streams = PyList_New((Py_ssize_t)in->stream_count);
  PyObject *other = oom_stream_to_dict(&in->other);
  if (report == NULL || streams == NULL || other == NULL) goto fail;
  for (size_t i = 0; i < in->stream_count; i++) {
    PyObject *s = oom_stream_to_dict(&in->streams[i]);
    if (s == NULL) goto fail;
    PyList_SET_ITEM(streams, (Py_ssize_t)i, s);
  }
  PyObject *log_event = Py_None;
  if (in->log_event == UINT64_MAX) {
    Py_INCREF(Py_None);
  } else {
    log_event = PyLong_FromUnsignedLongLong(in->log_event);
  }
  if (log_event == NULL) goto fail;
  /* N: the dict takes the references. */
  return Py_BuildValue(
      "{s:K,s:L,s:i,s:s,s:K,s:n,s:n,s:n,s:n,s:n,s:n,s:d,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:L,s:N,s:N,s:n,s:N,s:N}",
      "sequence", (unsigned long long)in->sequence, "time_ns", (long long)in->time_ns, "device", in->device, "backend",
      in->backend != NULL ? in->backend : "?", "stream", (unsigned long long)in->stream, "requested",
      (Py_ssize_t)in->requested, "rounded", (Py_ssize_t)in->rounded, "reserved", (Py_ssize_t)in->reserved, "allocated",
      (Py_ssize_t)in->allocated, "cached_free", (Py_ssize_t)in->cached_free, "largest_free_block",
      (Py_ssize_t)in->largest_free_block, "fragmentation", in->fragmentation, "pending_free",
      (Py_ssize_t)in->pending_free, "segments", (Py_ssize_t)in->segments, "live_blocks", (Py_ssize_t)in->live_blocks,
      "free_blocks", (Py_ssize_t)in->free_blocks, "pending_blocks", (Py_ssize_t)in->pending_blocks, "device_free",
      (Py_ssize_t)in->device_free, "device_total", (Py_ssize_t)in->device_total, "memory_cap",
      (Py_ssize_t)in->memory_cap, "paused", (Py_ssize_t)in->paused, "num_ooms", (long long)in->num_ooms, "log_event",
      log_event, "streams", streams, "other_streams", (Py_ssize_t)in->other_streams, "other", other, "report", report);
fail:
  Py_XDECREF(report);
  Py_XDECREF(streams);
  Py_XDECREF(other);
  return NULL;
}

static int config_format(const void *cfg, char *buf, size_t size) { return cp_config_format(cfg, buf, size); }

PyObject *cpy_config_to_str(const cp_config_t *cfg) { return cpy_formatted(config_format, cfg, "cp_config_format"); }

PyObject *cpy_formatted(cpy_format_fn format, const void *arg, const char *what) {
  char small[4096];
  int n = format(arg, small, sizeof small);
  if (n >= 0 && (size_t)n < sizeof small) return PyUnicode_DecodeUTF8(small, n, "replace");
  char *big = n < 0 ? NULL : PyMem_Malloc((size_t)n + 1);
  if (n >= 0 && big == NULL) return PyErr_NoMemory();
  const int m = n < 0 ? n : format(arg, big, (size_t)n + 1);
  PyObject *text = m < 0 ? NULL : PyUnicode_DecodeUTF8(big, m < n ? m : n, "replace");
  PyMem_Free(big);
  if (m < 0) PyErr_Format(PyExc_RuntimeError, "%s failed", what);
  return text;
}
