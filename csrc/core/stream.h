/* stream.h — per-stream state and the PENDING lifecycle (stream.c). */
#ifndef CP_STREAM_H
#define CP_STREAM_H

#include <pthread.h>

#include "base/ptrmap.h"
#include "core/index.h"

/* ------------------------------------------------------------------------------------------
 * Streams and stream ordering (stream.c): the whole PENDING lifecycle.
 *
 * Each stream the pool has seen has a state: its free-block indexes, and a FIFO of events
 * recorded on it for blocks that were used there (record_stream) and then freed. Events on
 * one stream complete in order, so polling stops at the first incomplete one. stream.c puts a
 * block into PENDING when it is freed with uses, and hands it back to the pool (a list of
 * blocks, in completion order) once every event it waits for has completed; it never calls
 * into pool.c. Invariants:
 *   sum over streams of |queue| == pending_entries
 *   pending_entries + detached_entries == sum over PENDING blocks of pending_events
 *   pending_blocks, pending_bytes == count and bytes of PENDING blocks
 * ---------------------------------------------------------------------------------------- */

typedef struct cp_pending_s {
  cp_event_t event;
  cp_block_t *block;
  cp_stream_state_t *stream; /* the stream the event was recorded on */
} cp_pending_t;

struct cp_stream_state_s {
  cp_stream_t handle;
  cp_index_t index[CP_KIND_COUNT]; /* [CP_KIND_SMALL], [CP_KIND_LARGE]; [CP_KIND_ALL] unused */
  cp_pending_t *queue;             /* ring buffer */
  size_t queue_head;               /* index of the oldest entry */
  size_t queue_len;
  size_t queue_cap; /* power of two, or 0 */
  /* Note [Stream-ordered release] (drain.c): memory of this stream retired for unmapping
   * (DRAINING blocks, retired stitched ranges) goes once `drain_event`, recorded on this
   * stream after the retirement, has completed. */
  bool draining;
  bool reaping;           /* a thread is unmapping what it retired (the lock drops meanwhile) */
  size_t draining_bytes;  /* bytes of its DRAINING blocks */
  cp_event_t drain_event; /* valid while draining */
  /* Regions (Note [Regions], region.c): a state serves the allocations of one region on its
   * stream (tag 0: untagged, the only one in `map`); a tagged state is found by
   * cp_streams_get_tagged_locked. Paused (pause.c): it serves nothing, nothing of it is
   * retired, trimmed or reaped; `busy` while a pause or resume of it runs without the lock.
   * Invariant: paused_bytes == sum of seg->paused over its segments. */
  uint32_t tag;
  bool paused;
  bool busy;
  size_t paused_bytes;
  struct cp_backup_s *backups; /* the pause's copies of its live blocks, until resume */
  size_t backup_count;
  size_t backup_bytes;
};

/* A live block's bytes, copied to host memory by a pause (pause.c). */
typedef struct cp_backup_s {
  uintptr_t addr;
  size_t size;
  void *host; /* the backend's host_alloc */
} cp_backup_t;

typedef struct cp_streams_s {
  const cp_backend_t *backend; /* the pool's; events are created and recorded through it */
  cp_ptrmap_t map;             /* stream handle -> cp_stream_state_t */
  cp_stream_state_t **list;    /* every state, in creation order */
  size_t count;
  size_t list_cap;
  cp_stream_state_t *last; /* one-entry cache in front of `map` */

  cp_event_t *spare_events; /* created events not in use */
  size_t spare_event_count;
  size_t spare_event_cap;
  size_t events_created; /* live backend events owned by the pool */

  size_t pending_entries;  /* queued (event, block) pairs over all streams */
  size_t pending_bytes;    /* bytes of PENDING blocks */
  size_t pending_blocks;   /* PENDING blocks */
  size_t detached_entries; /* pending entries taken out for synchronizing */
} cp_streams_t;

/* Blocks handed back by stream.c: PENDING blocks whose events have all completed, chained
 * through `left` (unused while a block is out of the index), oldest completion first. The
 * pool returns each to its free index. */
typedef struct cp_done_list_s {
  cp_block_t *head;
  cp_block_t *tail;
} cp_done_list_t;

int cp_streams_init(cp_streams_t *ss, const cp_backend_t *backend); /* CP_ERR_HOST_OOM */
/* Destroy every queued and spare event and every state (PENDING blocks are the pool's). */
void cp_streams_destroy(cp_streams_t *ss);
/* The state of `stream`, created on first use. NULL only when host memory ran out. */
cp_stream_state_t *cp_streams_lookup_locked(cp_streams_t *ss, cp_stream_t stream);
static inline cp_stream_state_t *cp_streams_get_locked(cp_streams_t *ss, cp_stream_t stream) {
  cp_stream_state_t *st = ss->last;
  return st != NULL && st->handle == stream ? st : cp_streams_lookup_locked(ss, stream);
}
/* The state of region `tag` (> 0) on `stream`, created on first use (not in `map`, never
 * `last`). NULL only when host memory ran out. */
cp_stream_state_t *cp_streams_get_tagged_locked(cp_streams_t *ss, cp_stream_t stream, uint32_t tag);
/* Give back a state's backups (host_free each). */
void cp_streams_drop_backups(cp_streams_t *ss, cp_stream_state_t *st);
/* An event from the pool's spares (created when there is none), and back to them. */
int cp_streams_event_acquire_locked(cp_streams_t *ss, cp_event_t *out_event);
void cp_streams_event_release_locked(cp_streams_t *ss, cp_event_t event);
/* Declare that the LIVE block `b` is used on `stream` too (no device call). */
int cp_streams_record_use_locked(cp_block_t *b, cp_stream_t stream);
/* Free a LIVE block with uses: record an event on each use stream and make it PENDING. All or
 * nothing: on failure the block stays LIVE and the last error says why. */
int cp_streams_defer_free_locked(cp_streams_t *ss, cp_block_t *b);
/* Hand back every PENDING block whose events have all completed (non-blocking). A failed
 * query leaves the rest queued: the next poll asks again. */
int cp_streams_poll_locked(cp_streams_t *ss, cp_done_list_t *done);
/* Wait for every pending event, with `lock` (the pool's, held on entry and on return)
 * dropped while waiting, and hand back their blocks. An event the device failed to wait for
 * goes back on its stream's queue. *out_waited is set when there was anything to wait for. */
int cp_streams_synchronize_locked(cp_streams_t *ss, pthread_mutex_t *lock, cp_done_list_t *done, bool *out_waited);

#endif /* CP_STREAM_H */
