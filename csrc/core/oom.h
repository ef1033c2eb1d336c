/* oom.h — out of memory: the pool's record of a failure and the event log (oom.c). */
#ifndef CP_OOM_H
#define CP_OOM_H

#include "core/state.h"

/* Append one event to the log (nothing when it is off: one branch). */
static inline void cp_evlog_put_locked(cp_pool_t *pool, uint8_t action, uintptr_t id, size_t size, cp_stream_t stream) {
  cp_evlog_t *lg = &pool->evlog;
  if (lg->cap == 0) return;
  cp_trace_event_t *e = &lg->ring[lg->next & lg->mask];
  e->action = action;
  e->device = pool->backend.device;
  e->id = id;
  e->size = size;
  e->stream = stream;
  e->time_ns = -1;
  lg->next++;
}

/* A failed allocation, lock held: fill *out with the pool's figures (not the device's),
 * count it in the pool's sequence, log it and keep nothing yet (cp_oom_publish keeps it). */
void cp_oom_fail_locked(cp_pool_t *pool, size_t size, size_t rounded, cp_stream_t stream, cp_oom_info_t *out);
/* Without the lock: ask the device for its free and total memory into *info, then make it
 * the pool's latest record (unless a later failure got there first). */
void cp_oom_publish(cp_pool_t *pool, cp_oom_info_t *info);
/* At destroy. */
void cp_evlog_destroy(cp_evlog_t *lg);

#endif /* CP_OOM_H */
