/* backend.h — the device contract the pool is written against.
 * Owns: the operation table every backend (cuda, sim) implements; nothing else. */
#ifndef CP_BACKEND_H
#define CP_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "base/status.h"

/* Opaque handles. A stream is whatever the device calls a stream (cudaStream_t for CUDA,
 * any integer for sim); 0 is the device's default stream. An event is owned by the backend. */
typedef uintptr_t cp_stream_t;
typedef uintptr_t cp_event_t;

/* Device ordinals run from 0 to CP_MAX_DEVICES - 1 in every layer (backends, device table). */
#define CP_MAX_DEVICES 64

/* The contract, stated once for every entry:
 *  - 0 (CP_OK) is success; results come back through out-parameters, which are untouched
 *    on failure.
 *  - CP_ERR_OOM means "the device has no memory for this"; any other failure is
 *    CP_ERR_BACKEND, and the backend has set the thread's last error (cp_set_error) with
 *    the call that failed and the device's own error name.
 *  - reserve, release, event_synchronize and mem_info are called without the pool lock
 *    (they may block or take long). event_create, event_record and event_query are called
 *    under the pool lock: they must not wait for device work.
 *  - `ctx` is the backend's own state; entries are thread-safe with respect to it. */
typedef struct cp_backend_s {
  const char *name; /* "sim", "cuda" */
  void *ctx;
  int device; /* device ordinal this instance serves */

  /* Device memory. `size` > 0; the returned address is aligned to at least 512 bytes. */
  int (*reserve)(void *ctx, size_t size, uintptr_t *out_addr);
  int (*release)(void *ctx, uintptr_t addr, size_t size);

  /* Events: created once, pooled by the core, recorded many times. */
  int (*event_create)(void *ctx, cp_event_t *out_event);
  int (*event_destroy)(void *ctx, cp_event_t event);
  int (*event_record)(void *ctx, cp_event_t event, cp_stream_t stream);
  int (*event_query)(void *ctx, cp_event_t event, int *out_done); /* never blocks */
  int (*event_synchronize)(void *ctx, cp_event_t event);          /* blocks until done */

  /* Free and total device memory in bytes. */
  int (*mem_info)(void *ctx, size_t *out_free, size_t *out_total);
} cp_backend_t;

#endif /* CP_BACKEND_H */
