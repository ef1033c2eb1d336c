/* drain.c — page-mapped memory given back in stream order: retired first, unmapped once the
 * work queued on its stream has finished. Owns: the drain events and when retired memory goes. */
#include "core/drain.h"
#include "core/capture.h"
#include "core/expand.h"
#include "core/stitch.h"

/* Note [Stream-ordered release]
 * A GPU runs behind the host: when the pool frees a block, kernels that use it may still be
 * queued on its stream. Reusing the block on that stream is safe (stream order), but unmapping
 * its pages, or giving their addresses back, is not ordered on any stream: a kernel still
 * queued would fault (a sticky error that loses the process), or read and write the pages the
 * next mapping puts there. The driver reference calls cuMemUnmap synchronous only "for most
 * use cases", and PyTorch waits for the segment's stream before every unmap. Waiting makes
 * empty_cache a stall of the host; the pool instead gives page-mapped memory back in two steps:
 *  1. Retire (empty_cache, the OOM ladder's retry, the trim of kept stitched ranges): the
 *     whole free chunks of each page-mapped segment become DRAINING blocks (out of every
 *     index: nothing is placed on them again), idle stitched ranges are retired (they never
 *     serve again), and one event, the stream's drain event, is recorded on each stream whose
 *     memory was retired. A stream's blocks serve only that stream, and a block used on other
 *     streams (record_stream) is FREE only once their events completed, so that one event
 *     covers every use of what was retired. Retiring again re-records the same event: events of
 *     one stream complete in order, so the later record covers the earlier retirement too.
 *  2. Reap: once the drain event has completed, the stream's retired ranges are unmapped and
 *     their addresses given back, then the DRAINING blocks are unmapped (a page is freed only
 *     when unmapped everywhere, so the ranges go first), and a segment left wholly unmapped
 *     gives back its address range. empty_cache reaps what is done at once (its own event is
 *     done already on an idle stream) and waits for nothing; memory still used by queued work
 *     stays reserved, and a later empty_cache or allocation of the stream gives it back. The
 *     OOM retry waits for the drain events (event_synchronize: those streams only, never the
 *     whole device) and reaps.
 * An allocation of a stream that would otherwise stitch or map anew, while DRAINING memory of
 * the stream waits, first reaps the stream if its event is done, and else puts that memory
 * back into service (DRAINING -> FREE): it is still mapped, and the stream needs it more than
 * the device does. A range retired by the trim of kept ranges may serve again too (stitch.c).
 * During a capture nothing is retired, reaped or trimmed: the driver refuses event queries on
 * a capturing stream and memory given back during a capture may still be used by its graph. */

/* Retire the whole free handles of the page-mapped segment `seg`: FREE -> DRAINING, leaving out
 * free pages a stitched block in use still maps behind its end (stitch.c). Returns the bytes
 * retired. No device call. */
static size_t cp_drain_retire_segment_locked(cp_pool_t *pool, cp_segment_t *seg) {
  size_t bytes = 0;
  for (cp_block_t *b = seg->head; b != NULL; b = b->next) {
    if (b->state != CP_BLOCK_FREE) continue;
    const uintptr_t lo = cp_expand_edge_up(seg, b->addr); /* whole handles only */
    uintptr_t hi = cp_expand_edge_down(seg, b->addr + b->size);
    if (pool->stitch && lo < hi) {
      hi = cp_stitch_alias_from_locked(pool, seg, lo, hi);
      if (lo < hi) hi = cp_expand_edge_down(seg, hi);
    }
    if (lo >= hi) continue;
    cp_block_t *mid = cp_expand_retire_range_locked(pool, b, lo, hi);
    if (mid == NULL) break; /* no metadata: the rest stays in service */
    bytes += mid->size;
    b = mid;
  }
  return bytes;
}

/* The drain of `st` is over: its event goes back to the spares. */
static void cp_drain_end_locked(cp_pool_t *pool, cp_stream_state_t *st) {
  if (!st->draining) return;
  cp_streams_event_release_locked(&pool->streams, st->drain_event);
  st->draining = false;
  pool->draining_streams--;
}

/* The DRAINING blocks of `st`'s segments back to FREE. */
static void cp_drain_revive_blocks_locked(cp_pool_t *pool, const cp_stream_state_t *st) {
  for (cp_segment_t *seg = pool->segments; seg != NULL; seg = seg->next) {
    if (seg->paged && seg->stream == st) cp_expand_revive_locked(pool, seg);
  }
}

void cp_drain_revive_locked(cp_pool_t *pool, cp_stream_state_t *st) {
  cp_drain_revive_blocks_locked(pool, st);
  if (pool->stitch) cp_stitch_revive_locked(pool, st);
  cp_drain_end_locked(pool, st);
}

int cp_drain_arm_locked(cp_pool_t *pool, cp_stream_state_t *st) {
  const cp_backend_t *be = &pool->backend;
  int rc = CP_OK;
  if (!st->draining) {
    rc = cp_streams_event_acquire_locked(&pool->streams, &st->drain_event);
    if (rc == CP_OK) {
      st->draining = true;
      pool->draining_streams++;
    }
  }
  if (rc == CP_OK) rc = be->event_record(be->ctx, st->drain_event, st->handle);
  if (rc != CP_OK) cp_drain_revive_locked(pool, st); /* nothing goes back without its event */
  return rc;
}

int cp_drain_retire_all_locked(cp_pool_t *pool) {
  if (!pool->paged || pool->capture.windows != 0) return CP_OK;
  int first_rc = CP_OK;
  for (size_t i = 0; i < pool->streams.count; i++) {
    cp_stream_state_t *st = pool->streams.list[i];
    if (st->reaping || st->paused || cp_capturing_locked(pool, st->handle)) continue; /* not now */
    size_t retired = pool->stitch ? cp_stitch_retire_idle_locked(pool, st) : 0;
    for (cp_segment_t *seg = pool->segments; seg != NULL; seg = seg->next) {
      if (seg->paged && seg->stream == st) retired += cp_drain_retire_segment_locked(pool, seg);
    }
    if (retired == 0) continue; /* what it retired before keeps its event */
    const int rc = cp_drain_arm_locked(pool, st);
    if (rc != CP_OK && first_rc == CP_OK) first_rc = rc;
  }
  const int rc = cp_expand_drop_unmapped_locked(pool);
  return first_rc != CP_OK ? first_rc : rc;
}

/* The first page-mapped segment of `st` with a DRAINING block, or NULL. */
static cp_segment_t *cp_drain_next_segment_locked(const cp_pool_t *pool, const cp_stream_state_t *st) {
  for (cp_segment_t *seg = pool->segments; seg != NULL; seg = seg->next) {
    if (!seg->paged || seg->stream != st) continue;
    for (const cp_block_t *b = seg->head; b != NULL; b = b->next) {
      if (b->state == CP_BLOCK_DRAINING) return seg;
    }
  }
  return NULL;
}

/* Unmap what `st` retired (its drain event is done) and end its drain. */
static int cp_drain_reap_stream_locked(cp_pool_t *pool, cp_stream_state_t *st) {
  /* The stream stays draining until the end, and no other thread retires into it or reaps it
   * meanwhile: what is retired now is exactly what its event covers. */
  st->reaping = true;
  bool left = false;
  int first_rc = pool->stitch ? cp_stitch_drop_retired_locked(pool, st, &left) : CP_OK;
  /* Each unmap lets go of the lock: look for the next segment afresh. A segment leaves the
   * search once unmapped or revived (no DRAINING block is left in it either way). */
  for (cp_segment_t *seg; (seg = cp_drain_next_segment_locked(pool, st)) != NULL;) {
    if (left) { /* a range the device kept still maps pages here: unmapped, they would stay */
      cp_expand_revive_locked(pool, seg);
      continue;
    }
    bool dropped = false;
    const int rc = cp_expand_unmap_draining_locked(pool, seg, &dropped);
    if (rc != CP_OK && first_rc == CP_OK) first_rc = rc;
  }
  st->reaping = false;
  cp_drain_end_locked(pool, st);
  return first_rc;
}

/* Whether the drain event of `st` has completed; `wait` waits for it (lock dropped). */
static int cp_drain_done_locked(cp_pool_t *pool, cp_stream_state_t *st, bool wait, bool *out_done) {
  const cp_backend_t *be = &pool->backend;
  *out_done = false;
  int done = 0;
  if (wait) {
    const cp_event_t ev = st->drain_event;
    pthread_mutex_unlock(&pool->lock);
    int rc = be->event_synchronize(be->ctx, ev);
    pthread_mutex_lock(&pool->lock);
    if (rc != CP_OK) return rc;
    if (!st->draining || st->drain_event != ev) return CP_OK; /* another thread reaped it meanwhile */
  }
  int rc = be->event_query(be->ctx, st->drain_event, &done); /* re-recorded meanwhile: not done */
  if (rc == CP_OK) *out_done = done != 0;
  return rc;
}

int cp_drain_reap_all_locked(cp_pool_t *pool, bool wait) {
  if (pool->draining_streams == 0 || pool->capture.windows != 0) return CP_OK;
  int first_rc = CP_OK;
  for (size_t i = 0; i < pool->streams.count; i++) {
    cp_stream_state_t *st = pool->streams.list[i];
    if (!st->draining || st->reaping || st->paused || cp_capturing_locked(pool, st->handle)) continue;
    bool done = false;
    int rc = cp_drain_done_locked(pool, st, wait, &done);
    /* The lock dropped while waiting: a pause may have taken the stream out of service since. */
    if (rc == CP_OK && done && st->draining && !st->reaping && !st->paused) rc = cp_drain_reap_stream_locked(pool, st);
    if (rc != CP_OK && first_rc == CP_OK) first_rc = rc;
  }
  return first_rc;
}

bool cp_drain_reclaim_stream_locked(cp_pool_t *pool, cp_stream_state_t *st) {
  /* Only DRAINING memory can serve the request: retired stitched ranges map pages that are
   * free in their segments already, and wait for their event whatever happens here. */
  if (!st->draining || st->reaping || st->paused || st->draining_bytes == 0 || pool->capture.windows != 0) return false;
  bool done = false;
  if (cp_drain_done_locked(pool, st, false, &done) == CP_OK && done && st->draining && !st->reaping) {
    (void)cp_drain_reap_stream_locked(pool, st);
    return true;
  }
  if (!st->draining || st->reaping) return false;
  cp_drain_revive_blocks_locked(pool, st);
  bool ranges = false; /* retired ranges keep the drain (and its event) going */
  for (const cp_segment_t *s = pool->stitched; s != NULL && !ranges; s = s->next)
    ranges = s->stream == st && s->retired;
  if (!ranges) cp_drain_end_locked(pool, st);
  return true;
}

int cp_drain_release_now_locked(cp_pool_t *pool, cp_stream_state_t *st) {
  if (!pool->paged || st->reaping) return CP_OK;
  size_t retired = pool->stitch ? cp_stitch_retire_idle_locked(pool, st) : 0;
  for (cp_segment_t *seg = pool->segments; seg != NULL; seg = seg->next) {
    if (seg->paged && seg->stream == st) retired += cp_drain_retire_segment_locked(pool, seg);
  }
  if (retired == 0 && !st->draining) return CP_OK;
  /* No event: the caller has waited for every stream that used this memory. */
  return cp_drain_reap_stream_locked(pool, st);
}

void cp_drain_destroy(cp_pool_t *pool) {
  for (size_t i = 0; i < pool->streams.count; i++) cp_drain_end_locked(pool, pool->streams.list[i]);
}

void cp_drain_trim_locked(cp_pool_t *pool, cp_stream_state_t *st) {
  if (cp_capturing_locked(pool, st->handle)) return;
  if (pool->retired_ranges != 0) cp_drain_reap_all_locked(pool, pool->retired_ranges >= CP_STITCH_KEEP);
  cp_stream_state_t *of = cp_stitch_retire_lru_locked(pool, st);
  if (of != NULL) (void)cp_drain_arm_locked(pool, of);
}
