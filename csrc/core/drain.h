/* drain.h — page-mapped memory given back in stream order (drain.c),
 * Note [Stream-ordered release]. */
#ifndef CP_DRAIN_H
#define CP_DRAIN_H

#include "core/state.h"

/* Retire what every stream not being captured can give back (free whole chunks, idle
 * stitched ranges) and record each such stream's drain event. No waiting. */
int cp_drain_retire_all_locked(cp_pool_t *pool);
/* Arm the drain of `st` after something of it was retired: (re)record its drain event. On
 * failure what `st` retired comes back into service. */
int cp_drain_arm_locked(cp_pool_t *pool, cp_stream_state_t *st);
/* Unmap what the streams retired once their drain events are done: `wait` waits for them
 * (event_synchronize, those streams only, lock dropped); else only done ones are reaped. */
int cp_drain_reap_all_locked(cp_pool_t *pool, bool wait);
/* For `st` alone, while DRAINING memory of it waits: reap when its event is done, else put
 * that memory back into service (an allocation of the stream needs it more than the device
 * does). Returns whether memory came back. */
bool cp_drain_reclaim_stream_locked(cp_pool_t *pool, cp_stream_state_t *st);
/* For `st`, out of service, whose streams' work the caller has waited for (a pause): retire
 * what it can give back (free whole handles, idle stitched ranges) and unmap it now, ending
 * any drain of it. */
int cp_drain_release_now_locked(cp_pool_t *pool, cp_stream_state_t *st);
/* Put what `st` retired back into service (DRAINING blocks FREE again, retired ranges kept)
 * and end its drain. */
void cp_drain_revive_locked(cp_pool_t *pool, cp_stream_state_t *st);
/* At destroy: every drain event back to the spares (the memory is unmapped by destroy). */
void cp_drain_destroy(cp_pool_t *pool);
/* At CP_STITCH_KEEP kept stitched ranges, before another is stitched: retire the least
 * recently used idle one (unmapped once the work queued on its stream is done). Retired
 * ranges past CP_STITCH_KEEP are waited for first. Never during a capture. */
void cp_drain_trim_locked(cp_pool_t *pool, cp_stream_state_t *st);

#endif /* CP_DRAIN_H */
