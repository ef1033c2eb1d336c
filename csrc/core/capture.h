/* capture.h — the pool while a stream is captured into a graph (capture.c),
 * Note [Capture in the pool]. */
#ifndef CP_CAPTURE_H
#define CP_CAPTURE_H

#include <stdbool.h>

#include "core/state.h"

/* Graph capture (capture.c). cp_capturing_locked: whether an event call or a release now
 * could break a capture: a window is open, or the backend says `stream` is being captured. */
bool cp_capturing_locked(cp_pool_t *pool, cp_stream_t stream);
/* Whether freeing the LIVE block `b` (use_count > 0) must wait for the end of the capture. */
bool cp_capture_must_defer_locked(cp_pool_t *pool, const cp_block_t *b);
/* List `b` for freeing after the capture (CP_ERR_HOST_OOM, nothing changed); a block listed
 * already stays listed once (CP_ERR_INVALID: a second free of the same pointer). */
int cp_capture_defer_locked(cp_pool_t *pool, cp_block_t *b);
void cp_capture_destroy(cp_pool_t *pool);

#endif /* CP_CAPTURE_H */
