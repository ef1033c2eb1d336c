/* hooks_api.h — the table of functions cudapool._C lends its test-hook module,
 * cudapool._testhooks, through the capsule cudapool._C._hooks_api.
 *
 * Note [Test hooks]: the hooks tests use to steer the process-wide device table (fault
 * injection on simulated devices, the allocation entry point with its exception caught, the
 * fork and exit counters) are kept out of the production module. They must act on the same
 * state as _C, and that state lives in _C's shared object, which Python loads RTLD_LOCAL: a
 * second module linking its own copy of the core would get its own device table and its own
 * last-error slot. So _testhooks links no part of the core; _C exports this table of its own
 * functions in a capsule, and _testhooks calls through it (raising
 * cudapool._C.OutOfMemoryError, which it takes from the module). Bump CPY_HOOKS_API_VERSION when a
 * field changes; fields are only ever appended. */
#ifndef CPY_HOOKS_API_H
#define CPY_HOOKS_API_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stddef.h>
#include <stdint.h>

#include "backend/sim.h"

#define CPY_HOOKS_API_CAPSULE "cudapool._C._hooks_api"
#define CPY_HOOKS_API_VERSION 1

typedef struct cpy_hooks_api_s {
  unsigned version; /* CPY_HOOKS_API_VERSION */
  size_t size;      /* sizeof(cpy_hooks_api) */

  /* The binding's conversions (python/convert.h). */
  PyObject *(*raise_status)(PyObject *oom_error, int status);
  int (*as_unsigned)(PyObject *obj, const char *what, unsigned long long max, unsigned long long *out);
  int (*as_size)(PyObject *obj, const char *what, size_t *out);
  int (*as_uintptr)(PyObject *obj, const char *what, uintptr_t *out);
  int (*parse_device)(PyObject *obj, int *out);
  int (*parse_call_kind)(const char *kind_name, cp_sim_call_t *out);

  /* Status (base/status.h). */
  void (*clear_error)(void);

  /* The device table and entry points (torch/devices.h, torch/abi.h). */
  cp_sim_t *(*device_sim)(int device);
  unsigned long (*failures_at_exit)(void);
  int (*alloc_catching)(size_t size, int device, void *stream, void **out_ptr, char *buf, size_t buf_size);

  /* The fork registry (base/fork.h). */
  unsigned long (*fork_count)(void);

  /* Simulated devices (backend/sim.h). */
  void (*sim_complete_all)(cp_sim_t *sim);
  void (*sim_delay_nth)(cp_sim_t *sim, cp_sim_call_t kind, uint64_t n, unsigned ms);
  uint64_t (*sim_delays_entered)(const cp_sim_t *sim);
  void (*sim_set_lost)(cp_sim_t *sim, int lost);
  int (*sim_invalidate_stream)(cp_sim_t *sim, cp_stream_t stream);
  int (*sim_set_capturing)(cp_sim_t *sim, cp_stream_t stream, int on);
  uint64_t (*sim_capture_violations)(const cp_sim_t *sim);
  uint64_t (*sim_calls)(const cp_sim_t *sim, cp_sim_call_t kind);
  int (*sim_launch)(cp_sim_t *sim, cp_stream_t stream, uintptr_t ptr, size_t bytes);
  uint64_t (*sim_device_faults)(const cp_sim_t *sim);
} cpy_hooks_api;

#endif /* CPY_HOOKS_API_H */
