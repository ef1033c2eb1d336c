/* history.h — the history ring behind snapshots (history.c), Note [History]. */
#ifndef CP_HISTORY_H
#define CP_HISTORY_H

#include <stdint.h>

#include "core/snapshot.h"
#include "core/state.h"

/* ------------------------------------------------------------------------------------------
 * History (history.c), Note [History]: a ring of cp_history_entry_t, recorded under the pool
 * lock. Invariants: count <= capacity; count == min(records made since the ring was made, capacity);
 * the oldest record is at (head - count) mod capacity, the newest at head - 1.
 * ---------------------------------------------------------------------------------------- */

typedef struct cp_history_s {
  cp_history_entry_t *ring;
  size_t capacity; /* > 0 */
  size_t head;     /* where the next record goes */
  size_t count;    /* records held */
} cp_history_t;

/* Record one event when history is on: one predictable branch when it is off. Lock held. */
#define CP_HISTORY(pool, action, addr, size, stream)                                                                \
  do {                                                                                                              \
    if (CP_UNLIKELY((pool)->history != NULL)) cp_history_record_locked((pool), (action), (addr), (size), (stream)); \
  } while (0)

/* A change of the device memory behind the pool (Note [Segment observer]): recorded in the
 * history, and told to the segment observer. Lock held. */
#define CP_SEGMENT_EVENT(pool, action, addr, size, stream)                                                   \
  do {                                                                                                       \
    CP_HISTORY(pool, action, addr, size, stream);                                                            \
    if (CP_UNLIKELY((pool)->segment_observer != NULL))                                                       \
      (pool)->segment_observer((pool)->segment_observer_ctx, (action), (uintptr_t)(addr), (size), (stream)); \
  } while (0)

CP_COLD void cp_history_record_locked(cp_pool_t *pool, int action, uintptr_t addr, size_t size, cp_stream_t stream);
/* The end of cp_alloc: ALLOC of the block at `ptr` when rc is CP_OK, OOM of `size` bytes when
 * it is CP_ERR_OOM, nothing otherwise. */
CP_COLD void cp_history_alloc_locked(cp_pool_t *pool, int rc, const void *ptr, size_t size, cp_stream_t stream);
/* A free: FREE_REQUESTED, and FREE_COMPLETED too when the block is reusable at once. */
CP_COLD void cp_history_free_locked(cp_pool_t *pool, const cp_block_t *b);
/* At destroy. */
void cp_history_destroy(cp_pool_t *pool);

#endif /* CP_HISTORY_H */
