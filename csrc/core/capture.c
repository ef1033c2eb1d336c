/* capture.c — the pool while a stream is captured into a graph: no event call, no memory back.
 * Owns: capture windows, and the frees that wait for the end of a capture. */
#include <stdlib.h>

#include "core/capture.h"

/* Note [Capture in the pool]
 * While a stream is captured into a graph (CUDA graphs), the driver refuses event queries,
 * event records and synchronizations, and frees of memory (in the global capture mode, from
 * any thread), and the capture is lost. The caller opens a capture window on the pool before
 * the capture begins (cp_pool_capture_begin: torch's begin-allocate-to-pool hook) and closes
 * it after it ended; the backend can also say that a stream is being captured
 * (stream_capturing, Note [Stream capture]). While either holds:
 *  - completed frees are not polled: a block freed with uses on other streams stays PENDING;
 *  - a free that must record events (a block with record_stream uses) is deferred: the block
 *    stays LIVE and listed, and is freed (its events recorded) by the first allocation, free
 *    or empty_cache after the last window closed, or by the closing itself;
 *  - growth reserves (the backend does so without joining the capture), but no cached memory
 *    is given back first (garbage collection, release_before_grow), and out of memory does
 *    not wait for pending frees nor empty the cache: it fails at once;
 *  - empty_cache does nothing.
 * Reuse of cached blocks, splitting and merging need no device call and go on as always. */

bool cp_capturing_locked(cp_pool_t *pool, cp_stream_t stream) {
  if (pool->capture.windows != 0) return true;
  if (pool->backend.stream_capturing == NULL) return false;
  int capturing = 0;
  /* A failed query (a lost device) counts as no capture: the event call that follows then
   * fails and says why, where a deferral would hide it. */
  if (pool->backend.stream_capturing(pool->backend.ctx, stream, &capturing) != CP_OK) return false;
  return capturing != 0;
}

bool cp_capture_must_defer_locked(cp_pool_t *pool, const cp_block_t *b) {
  if (cp_capturing_locked(pool, b->segment->stream->handle)) return true;
  for (uint32_t i = 0; i < b->use_count; i++) {
    if (cp_capturing_locked(pool, b->uses[i])) return true;
  }
  return false;
}

/* Index of `b` in the deferred list, or deferred_count. */
static size_t cp_capture_find_locked(const cp_pool_t *pool, const cp_block_t *b) {
  size_t i = 0;
  while (i < pool->capture.deferred_count && pool->capture.deferred[i] != b) i++;
  return i;
}

/* CP_ERR_STATE: `b` need not wait (not listed, nothing captured): free it now. */
int cp_capture_defer_locked(cp_pool_t *pool, cp_block_t *b) {
  cp_capture_t *c = &pool->capture;
  if (cp_capture_find_locked(pool, b) != c->deferred_count) {
    return cp_set_error(CP_ERR_INVALID, "cp_free: %p was already freed (its free waits for the end of a capture)",
                        (void *)b->addr);
  }
  if (b->use_count == 0 || !cp_capture_must_defer_locked(pool, b)) return CP_ERR_STATE;
  if (c->deferred_count == c->deferred_cap) {
    size_t cap = c->deferred_cap ? c->deferred_cap * 2 : 16;
    cp_block_t **list = realloc(c->deferred, cap * sizeof *list);
    if (list == NULL) {
      return cp_set_error(CP_ERR_HOST_OOM, "cp_free(%p): no host memory to defer the free past the capture",
                          (void *)b->addr);
    }
    c->deferred = list;
    c->deferred_cap = cap;
  }
  c->deferred[c->deferred_count++] = b;
  return CP_OK;
}

void cp_capture_destroy(cp_pool_t *pool) {
  free(pool->capture.deferred);
  pool->capture.deferred = NULL;
  pool->capture.deferred_count = pool->capture.deferred_cap = 0;
}

void cp_pool_backend(cp_pool_t *pool, cp_backend_t *out_backend) { *out_backend = pool->backend; }
