/* convert.h — conversions between Python objects and the core's values, and the mapping of
 * status codes to Python exceptions. Owns no state: every function works on its arguments. */
#ifndef CPY_CONVERT_H
#define CPY_CONVERT_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stddef.h>
#include <stdint.h>

#include "backend/sim.h"
#include "core/cp.h"

/* Raise the Python exception for a failed core call and return NULL: CP_ERR_OOM ->
 * `oom_error` (cudapool._C.OutOfMemoryError), CP_ERR_INVALID -> ValueError, CP_ERR_HOST_OOM ->
 * MemoryError, anything else -> RuntimeError "<status name>: <message>". The message is the
 * core's last error (cleared before every call), else the status's name. */
PyObject *cpy_raise_status(PyObject *oom_error, int status);

/* A Python int (or __index__) as an unsigned value <= max; `what` names it in errors.
 * Negative: ValueError. Larger than max: OverflowError. Not an integer: TypeError. */
int cpy_as_unsigned(PyObject *obj, const char *what, unsigned long long max, unsigned long long *out);
int cpy_as_size(PyObject *obj, const char *what, size_t *out);
int cpy_as_uintptr(PyObject *obj, const char *what, uintptr_t *out);

/* A sequence of (id, offset, size, requested) tuples as seed blocks (PyMem_Malloc'ed: the
 * caller frees *out with PyMem_Free). TypeError, ValueError or OverflowError naming the bad one. */
int cpy_parse_seed_blocks(PyObject *seq, cp_seed_block_t **out, size_t *out_n);

/* A device index in 0..CP_MAX_DEVICES-1; ValueError "invalid device ..." otherwise
 * (TypeError for a non-integer). */
int cpy_parse_device(PyObject *obj, int *out);

/* A backend call kind by its name ("reserve", "event_record", ...); ValueError listing the
 * names otherwise. */
int cpy_parse_call_kind(const char *kind_name, cp_sim_call_t *out);

PyObject *cpy_from_size(size_t value);
PyObject *cpy_from_ptr(const void *ptr);

/* A tuple of the first `n` strings of `names`. */
PyObject *cpy_str_tuple(const char *const *names, size_t n);

/* The names of a statistic's four metrics, in cp_stat_t's order. */
extern const char *const cpy_stat_metric_names[4];

/* Statistics as torch's flat dict ("allocated_bytes.all.current": ...). */
PyObject *cpy_stats_to_dict(const cp_stats_t *stats);
/* Every field of cp_pool_info_t as a dict. */
PyObject *cpy_info_to_dict(const cp_pool_info_t *info);
/* An out-of-memory record as a dict: every field, "streams" a list of dicts, "other" one,
 * "log_event" None when no log was kept, and "report", the text cp_oom_format writes. */
PyObject *cpy_oom_to_dict(const cp_oom_info_t *info);
/* A configuration in its "key:value,..." form. */
PyObject *cpy_config_to_str(const cp_config_t *cfg);
/* A formatter as the core's are (cp_config_format, cp_oom_format): writes what fits of the text
 * into buf (NUL-terminated) and returns the whole text's length, or < 0 when it fails. */
typedef int (*cpy_format_fn)(const void *arg, char *buf, size_t size);
/* The whole text `format` writes of `arg`, as a str (a second call with room for all of it when
 * 4 KiB were short); NULL with RuntimeError "<what> failed" when the formatter fails. */
PyObject *cpy_formatted(cpy_format_fn format, const void *arg, const char *what);

#endif /* CPY_CONVERT_H */
