/* pool.c — the pool's ladder: which memory source serves a request and in which order (best
 * fit, stream-ordered reclaim, stitching, growth, the OOM ladder), frees, empty_cache, and the
 * pool's life. Owns: the pool lock, and the public entry points that change the pool. The
 * memory sources are below it (segment.c, expand.c, stitch.c, each on block.c's blocks). */
#include <stdlib.h>

#include "core/capture.h"
#include "core/check.h"
#include "core/drain.h"
#include "core/expand.h"
#include "core/history.h"
#include "core/oom.h"
#include "core/plan.h"
#include "core/plan_learn.h"
#include "core/pool.h"
#include "core/segment.h"
#include "core/stitch.h"
#include "core/stitch_alloc.h"

/* Note [Lock rules]
 * One mutex per pool guards all of its state. Public functions take it once and never call
 * another public function while holding it; `_locked` functions expect it held. The lock is
 * dropped around every backend call that may block or take long (reserve, release,
 * event_synchronize, mem_info); while it is dropped, the bytes being reserved are counted
 * in `inflight_bytes` so that concurrent growth respects the cap, and segments being
 * released are already out of the pool. Event record and query are asynchronous and are
 * made under the lock. The size rules are in core/sizes.h; when a freed block must wait for
 * other streams, and when it comes back, is stream.c's (Note [Stream ordering]). */

/* ------------------------------------------------------------------------------------------
 * Blocks leaving use, and frees that complete later
 * ---------------------------------------------------------------------------------------- */

/* Return a PENDING or LIVE block to its source (its active figures leave the stats): a planned
 * block's place in the plan is free again (plan.c); a stitched block's range is kept for reuse
 * and its pages go back to their segments (stitch.c); any other merges into the free index. */
static void cp_block_release_locked(cp_pool_t *pool, cp_block_t *b) {
  cp_block_end_use_locked(pool, b);
  if (CP_UNLIKELY(b->plan == CP_PLAN_NODE)) {
    cp_plan_release_locked(pool, b); /* its place in the plan is free */
    return;
  }
  cp_stitch_give_back_locked(pool, b);
}

/* Blocks stream.c handed back: each returns to its free index, in completion order. */
static void cp_release_done_locked(cp_pool_t *pool, cp_done_list_t *done) {
  for (cp_block_t *b = done->head, *next; b != NULL; b = next) {
    next = b->left;
    CP_HISTORY(pool, CP_HIST_FREE_COMPLETED, b->addr, b->size, b->segment->stream->handle);
    cp_block_release_locked(pool, b);
  }
  done->head = done->tail = NULL;
}

/* Reuse what completed frees give back (non-blocking). A failed event query leaves those
 * blocks pending: not fatal. */
int cp_reclaim_completed_locked(cp_pool_t *pool) {
  cp_done_list_t done = {NULL, NULL};
  const int rc = cp_streams_poll_locked(&pool->streams, &done);
  cp_release_done_locked(pool, &done);
  return rc;
}

/* Wait (without the lock) for every pending free, then return those blocks to the index. */
int cp_synchronize_pending_locked(cp_pool_t *pool) {
  cp_done_list_t done = {NULL, NULL};
  bool waited = false;
  int rc = cp_streams_synchronize_locked(&pool->streams, &pool->lock, &done, &waited);
  if (waited) pool->stats.num_sync_all_streams++;
  cp_release_done_locked(pool, &done);
  return rc;
}

/* Free the LIVE block `b`: with uses on other streams, record an event on each and leave it
 * PENDING; else give it back at once. On failure the block stays allocated. */
int cp_free_block_locked(cp_pool_t *pool, cp_block_t *b, const char *who) {
  if (b->use_count > 0) {
    int rc = cp_streams_defer_free_locked(&pool->streams, b);
    if (rc != CP_OK) {
      char why[1024];
      snprintf(why, sizeof why, "%s", cp_last_error());
      return cp_set_error(rc,
                          "%s(%p): %s; not freed (the block stays allocated: the work of a stream it was used on "
                          "cannot be tracked)",
                          who, (void *)b->addr, why);
    }
  }
  if (CP_UNLIKELY(b->plan_seq != 0)) cp_plan_watch_free_locked(pool, b); /* the step's learning watched it */
  cp_ptrmap_remove(&pool->live, b->addr);
  int kind = b->segment->kind;
  cp_stats_dec(&pool->stats, CP_STAT_ALLOCATION, kind, 1);
  cp_stats_dec(&pool->stats, CP_STAT_ALLOCATED_BYTES, kind, b->size);
  if (b->size >= pool->cfg.max_split_size) cp_stat_dec(&pool->stats.oversize_allocations, 1);
  if (CP_UNLIKELY(pool->history != NULL)) cp_history_free_locked(pool, b);
  cp_evlog_put_locked(pool, CP_TRACE_FREE, b->addr, b->requested, b->segment->stream->handle);
  if (b->state == CP_BLOCK_LIVE) cp_block_release_locked(pool, b); /* no other stream: reuse now */
  return CP_OK;
}

/* Free the blocks whose free waited for the end of a capture (Note [Capture in the pool]),
 * when no capture is under way. A free that fails (an event record refused) stays listed and
 * is tried again later. */
void cp_capture_flush_locked(cp_pool_t *pool) {
  cp_capture_t *c = &pool->capture;
  if (c->windows != 0) return;
  size_t kept = 0;
  for (size_t i = 0; i < c->deferred_count; i++) {
    cp_block_t *b = c->deferred[i];
    if (cp_capture_must_defer_locked(pool, b) || cp_free_block_locked(pool, b, "cp_free") != CP_OK) {
      c->deferred[kept++] = b;
    }
  }
  c->deferred_count = kept;
}

/* The effective cap: the smaller of memory_cap and memory_fraction * device total. */
static size_t cp_effective_cap(const cp_config_t *cfg, size_t device_total) {
  size_t cap = cfg->memory_cap;
  if (cfg->memory_fraction > 0 && device_total > 0) {
    size_t f = (size_t)(cfg->memory_fraction * (double)device_total);
    /* A fraction too small for one byte still caps: 0 would read as "no cap". */
    if (f == 0) f = 1;
    if (cap == 0 || f < cap) cap = f;
  }
  return cap;
}

/* ------------------------------------------------------------------------------------------
 * The ladder
 * ---------------------------------------------------------------------------------------- */

/* Note [The OOM ladder of page-mapped pools]
 * Best fit; memory of the stream waiting to go back; stitching (large requests); growth; on
 * OOM wait for pending frees, give back plain free segments and unmap free chunks, then all
 * of it once more (the plain pools' steps: Note [The OOM ladder]). */
static int cp_paged_alloc_locked(cp_pool_t *pool, cp_stream_state_t *st, int kind, size_t rounded, size_t size,
                                 void **out_ptr) {
  /* While a capture is under way: no event polled, no memory given back (Note [Capture in
   * the pool]); growth and stitching make no event or stream call. */
  if (pool->streams.pending_entries != 0 && !cp_capturing_locked(pool, st->handle)) cp_reclaim_completed_locked(pool);
  const bool stitch = pool->stitch && kind == CP_KIND_LARGE;
  for (int attempt = 0;; attempt++) {
    /* Every step below but the first may let go of the lock, and a pause of the region may
     * begin meanwhile: asked again after each (cp_expand_refuse_paused). */
    int rc = cp_expand_refuse_paused(st);
    if (rc != CP_OK) return rc;
    rc = cp_expand_take_fit_locked(pool, st, kind, rounded, size, out_ptr);
    if (rc != CP_ERR_OOM) return rc;
    /* Memory of this stream waiting to go back: unmapped when its work is done, else taken
     * back into service before anything is mapped anew (Note [Stream-ordered release]). */
    if (st->draining && !cp_capturing_locked(pool, st->handle) && cp_drain_reclaim_stream_locked(pool, st)) {
      rc = cp_expand_refuse_paused(st);
      if (rc == CP_OK) rc = cp_expand_take_fit_locked(pool, st, kind, rounded, size, out_ptr);
      if (rc != CP_ERR_OOM) return rc;
    }
    rc = CP_ERR_OOM;
    if (stitch) {
      bool full = false;
      rc = cp_stitch_alloc_locked(pool, st, rounded, size, false, out_ptr, &full);
      if (full) { /* room for one more kept range first */
        cp_drain_trim_locked(pool, st);
        rc = cp_expand_refuse_paused(st);
        if (rc != CP_OK) return rc;
        rc = cp_stitch_alloc_locked(pool, st, rounded, size, true, out_ptr, &full);
      }
    }
    if (rc == CP_ERR_OOM) rc = cp_expand_grow_locked(pool, st, kind, rounded, size, out_ptr);
    if (rc != CP_ERR_OOM || attempt == 1 || cp_capturing_locked(pool, st->handle)) return rc;
    /* The retry waits for pending frees and for the streams whose memory it gives back
     * (their drain events), never for the whole device (Note [Stream-ordered release]). */
    pool->stats.num_alloc_retries++;
    cp_synchronize_pending_locked(pool);
    cp_segment_release_free_locked(pool);
    cp_drain_retire_all_locked(pool);
    cp_drain_reap_all_locked(pool, true);
  }
}

/* ------------------------------------------------------------------------------------------
 * Public entry points
 * ---------------------------------------------------------------------------------------- */

int cp_pool_create(const cp_config_t *cfg, const cp_backend_t *backend, cp_pool_t **out_pool) {
  if (cfg == NULL || backend == NULL || out_pool == NULL) {
    return cp_set_error(CP_ERR_INVALID, "cp_pool_create: NULL argument");
  }
  int rc = cp_config_validate(cfg);
  if (rc != CP_OK) return rc;
  cp_pool_t *pool = calloc(1, sizeof *pool);
  if (pool == NULL) return cp_set_error(CP_ERR_HOST_OOM, "cp_pool_create: no host memory");
  pool->cfg = *cfg;
  pool->backend = *backend;
  if (cp_ptrmap_init(&pool->live, 1024) != CP_OK || cp_streams_init(&pool->streams, &pool->backend) != CP_OK) {
    cp_ptrmap_destroy(&pool->live);
    free(pool);
    return CP_ERR_HOST_OOM;
  }
  pthread_mutex_init(&pool->lock, NULL);
  cp_fork_register(&pool->fork_node, &pool->lock, CP_FORK_LEVEL_POOL);
  size_t dev_free = 0, dev_total = 0;
  if (pool->backend.mem_info(pool->backend.ctx, &dev_free, &dev_total) == CP_OK) pool->device_total = dev_total;
  pool->cap_bytes = cp_effective_cap(&pool->cfg, pool->device_total);
  cp_expand_init(pool);
  cp_plan_init(pool);
  pool->stats.max_split_size = cfg->max_split_size == SIZE_MAX ? -1 : (int64_t)cfg->max_split_size;
  cp_clear_error();
  *out_pool = pool;
  return CP_OK;
}

void cp_pool_destroy(cp_pool_t *pool) {
  if (pool == NULL) return;
  cp_fork_unregister(&pool->fork_node); /* before the pool lock: the registry's is outer */
  pthread_mutex_lock(&pool->lock);
  cp_plan_destroy(pool); /* its range is in a segment or a stitched range, unmapped below */
  for (cp_segment_t *seg = pool->segments, *next; seg != NULL; seg = next) {
    next = seg->next;
    for (cp_block_t *b = seg->head; b != NULL; b = b->next) free(b->uses);
    if (seg->paged)
      cp_expand_destroy_segment(pool, seg);
    else
      pool->backend.release(pool->backend.ctx, seg->addr, seg->size);
    free(seg);
  }
  pool->segments = NULL;
  cp_stitch_destroy(pool);
  cp_drain_destroy(pool);
  cp_streams_destroy(&pool->streams);
  cp_capture_destroy(pool);
  for (cp_block_slab_t *s = pool->slabs, *next; s != NULL; s = next) {
    next = s->next;
    free(s);
  }
  cp_ptrmap_destroy(&pool->live);
  cp_history_destroy(pool);
  cp_evlog_destroy(&pool->evlog);
  pthread_mutex_unlock(&pool->lock);
  pthread_mutex_destroy(&pool->lock);
  free(pool);
}

/* The state that serves region `tag` (> 0) on `stream`: NULL with *rc set when there is none
 * (no host memory), or when the region is paused. */
static CP_COLD cp_stream_state_t *cp_region_state_locked(cp_pool_t *pool, cp_stream_t stream, uint32_t tag, int *rc) {
  cp_stream_state_t *st = cp_streams_get_tagged_locked(&pool->streams, stream, tag);
  if (st == NULL) {
    *rc = CP_ERR_HOST_OOM;
  } else if ((*rc = cp_expand_refuse_paused(st)) != CP_OK) {
    st = NULL;
  }
  return st;
}

/* The step plan's turn (Note [Learning the step]); when its adoption needs an overflow range,
 * the ladder gives it (the plan never asks the ladder itself). */
static int cp_plan_locked(cp_pool_t *pool, size_t rounded, size_t size, cp_stream_t stream, void **out_ptr,
                          uint64_t *out_watch) {
  int rc = cp_plan_alloc_locked(pool, rounded, size, stream, out_ptr, out_watch);
  if (rc != CP_PLAN_OVERFLOW) return rc;
  const size_t bytes = pool->plan.overflow_bytes;
  cp_stream_state_t *st = cp_streams_get_locked(&pool->streams, pool->plan.overflow_stream);
  void *ptr = NULL;
  rc = st == NULL ? CP_ERR_HOST_OOM : cp_reserve_metadata_locked(pool, 1);
  if (rc == CP_OK) rc = cp_paged_alloc_locked(pool, st, CP_KIND_LARGE, bytes, bytes, &ptr);
  if (rc != CP_OK) cp_clear_error();
  cp_block_t *over = rc == CP_OK ? cp_ptrmap_get(&pool->live, (uintptr_t)ptr) : NULL;
  return cp_plan_adopt_finish_locked(pool, over, size, out_ptr);
}

/* Note [The OOM ladder]
 * 1. best fit in the (stream, kind) index, after reclaiming frees whose events completed;
 * 2. garbage collection (when configured): give back free segments above the threshold;
 * 3. grow: reserve a new segment from the backend (within the cap);
 * 4. retry (counted in num_alloc_retries): wait for every pending free, give back every
 *    wholly free segment, then best fit and grow once more;
 * 5. fail (counted in num_ooms) with a report of where the memory is. */
static inline int cp_alloc_impl(cp_pool_t *pool, size_t size, cp_stream_t stream, uint32_t tag, void **out_ptr) {
  if (pool == NULL || out_ptr == NULL) return cp_set_error(CP_ERR_INVALID, "cp_alloc: NULL argument");
  if (size == 0) {
    *out_ptr = NULL;
    return CP_OK;
  }
  const cp_config_t *cfg = &pool->cfg; /* only the cap fields change after creation */
  size_t rounded = cp_size_round(cfg, size);
  /* Stitching pools serve both sizes from one range per stream (Note [Stitched ranges]). */
  int kind = pool->stitch ? CP_KIND_LARGE : cp_size_kind(cfg, rounded);

  pthread_mutex_lock(&pool->lock);
  uint64_t watch = 0;
  if (CP_UNLIKELY(pool->plan.state != CP_PLAN_OFF) && tag == 0 && pool->capture.windows == 0 && rounded != 0 &&
      cp_plan_locked(pool, rounded, size, stream, out_ptr, &watch) == CP_OK) {
    CP_HISTORY(pool, CP_HIST_ALLOC, (uintptr_t)*out_ptr, rounded, stream);
    cp_evlog_put_locked(pool, CP_TRACE_ALLOC, (uintptr_t)*out_ptr, size, stream);
    CP_DEBUG_CHECK(pool, "cp_alloc");
    pthread_mutex_unlock(&pool->lock);
    return CP_OK;
  }
  int rc = CP_OK;
  cp_stream_state_t *st = NULL;
  if (rounded == 0) {
    rc = CP_ERR_OOM; /* larger than any address space */
  } else if ((rc = cp_reserve_metadata_locked(pool, 1)) == CP_OK) {
    if (CP_UNLIKELY(tag != 0) && pool->paged) { /* Note [Regions] */
      st = cp_region_state_locked(pool, stream, tag, &rc);
    } else {
      st = cp_streams_get_locked(&pool->streams, stream);
      if (st == NULL) rc = CP_ERR_HOST_OOM;
    }
  }
  if (rc == CP_OK && pool->capture.deferred_count != 0) cp_capture_flush_locked(pool);
  if (rc == CP_OK && pool->paged) {
    rc = cp_paged_alloc_locked(pool, st, kind, rounded, size, out_ptr);
    /* A plan that no longer fits is given up before anyone sees out of memory. */
    if (rc == CP_ERR_OOM && pool->plan.bins != NULL && cp_plan_give_up_locked(pool)) {
      rc = cp_reserve_metadata_locked(pool, 1);
      if (rc == CP_OK) rc = cp_paged_alloc_locked(pool, st, kind, rounded, size, out_ptr);
    }
  } else if (rc == CP_OK) {
    /* 1. */
    if (pool->streams.pending_entries != 0 && !cp_capturing_locked(pool, stream)) cp_reclaim_completed_locked(pool);
    cp_block_t *b = cp_segment_take_fit_locked(pool, st, kind, rounded, size, out_ptr);
    if (b != NULL) {
      CP_HISTORY(pool, CP_HIST_ALLOC, b->addr, b->size, stream);
      cp_evlog_put_locked(pool, CP_TRACE_ALLOC, (uintptr_t)*out_ptr, size, stream);
      CP_DEBUG_CHECK(pool, "cp_alloc");
      pthread_mutex_unlock(&pool->lock);
      return CP_OK;
    }
    /* 2, 3. The segment's size is worked out only here, off the path of reuse. */
    const size_t seg_size = cp_size_segment(cfg, rounded);
    bool capturing = false;
    if (seg_size == 0) {
      rc = CP_ERR_OOM; /* larger than any address space */
    } else {
      /* No memory goes back while a capture is under way (Note [Capture in the pool]). */
      capturing = cp_capturing_locked(pool, stream);
      rc = cp_segment_grow_locked(pool, st, kind, rounded, size, seg_size, !capturing, out_ptr);
    }
    if (rc == CP_ERR_OOM && seg_size != 0 && !capturing) {
      /* 4. */
      pool->stats.num_alloc_retries++;
      cp_synchronize_pending_locked(pool);
      cp_segment_release_free_locked(pool);
      rc = cp_reserve_metadata_locked(pool, 1);
      if (rc == CP_OK && cp_segment_take_fit_locked(pool, st, kind, rounded, size, out_ptr) == NULL) {
        rc = cp_segment_grow_locked(pool, st, kind, rounded, size, seg_size, false, out_ptr);
      }
    }
  }
  if (CP_UNLIKELY(pool->history != NULL))
    cp_history_alloc_locked(pool, rc, rc == CP_OK ? *out_ptr : NULL, size, stream);
  cp_oom_info_t oom;
  if (rc == CP_ERR_OOM) { /* 5. */
    pool->stats.num_ooms++;
    cp_oom_fail_locked(pool, size, rounded, stream, &oom);
  } else if (rc == CP_OK) {
    cp_evlog_put_locked(pool, CP_TRACE_ALLOC, (uintptr_t)*out_ptr, size, stream);
    if (CP_UNLIKELY(watch != 0)) cp_plan_watch_block_locked(pool, *out_ptr, watch);
  }
  CP_DEBUG_CHECK(pool, "cp_alloc");
  pthread_mutex_unlock(&pool->lock);
  if (rc == CP_ERR_OOM) {
    cp_oom_publish(pool, &oom);
    char report[4096];
    cp_oom_format(&oom, report, sizeof report);
    cp_set_error(CP_ERR_OOM, "%s", report);
  }
  return rc;
}

int cp_alloc(cp_pool_t *pool, size_t size, cp_stream_t stream, void **out_ptr) {
  return cp_alloc_impl(pool, size, stream, 0, out_ptr);
}

int cp_alloc_in(cp_pool_t *pool, size_t size, cp_stream_t stream, uint32_t tag, void **out_ptr) {
  return cp_alloc_impl(pool, size, stream, tag, out_ptr);
}

/* cp_free and cp_free_sized: `expect_size` NULL means "any size". */
static int cp_free_impl(cp_pool_t *pool, void *ptr, const size_t *expect_size, const char *who) {
  if (ptr == NULL) return CP_OK;
  if (pool == NULL) return cp_set_error(CP_ERR_INVALID, "%s: NULL pool", who);
  pthread_mutex_lock(&pool->lock);
  cp_block_t *b = cp_ptrmap_get(&pool->live, (uintptr_t)ptr);
  int rc = CP_OK;
  if (b == NULL) {
    rc = cp_set_error(CP_ERR_INVALID, "%s: %p was not allocated by this pool, or was already freed", who, ptr);
  } else if (expect_size != NULL && *expect_size != b->requested) {
    rc = cp_set_error(CP_ERR_INVALID,
                      "%s: %p was allocated with %zu bytes, not %zu: not freed (the block stays allocated)", who, ptr,
                      b->requested, *expect_size);
  } else if (pool->capture.deferred_count != 0 || (b->use_count > 0 && cp_capture_must_defer_locked(pool, b))) {
    rc = cp_capture_defer_locked(pool, b); /* Note [Capture in the pool] */
    if (rc == CP_ERR_STATE) rc = cp_free_block_locked(pool, b, who);
  } else {
    rc = cp_free_block_locked(pool, b, who);
  }
  CP_DEBUG_CHECK(pool, "cp_free");
  pthread_mutex_unlock(&pool->lock);
  return rc;
}

int cp_free(cp_pool_t *pool, void *ptr) { return cp_free_impl(pool, ptr, NULL, "cp_free"); }

int cp_free_sized(cp_pool_t *pool, void *ptr, size_t size) { return cp_free_impl(pool, ptr, &size, "cp_free_sized"); }

int cp_pool_lookup(cp_pool_t *pool, void *ptr, size_t *out_size) {
  if (pool == NULL || ptr == NULL) return 0;
  pthread_mutex_lock(&pool->lock);
  const cp_block_t *b = cp_ptrmap_get(&pool->live, (uintptr_t)ptr);
  if (b != NULL && out_size != NULL) *out_size = b->requested;
  pthread_mutex_unlock(&pool->lock);
  return b != NULL;
}

int cp_record_stream(cp_pool_t *pool, void *ptr, cp_stream_t stream) {
  if (pool == NULL) return cp_set_error(CP_ERR_INVALID, "cp_record_stream: NULL pool");
  pthread_mutex_lock(&pool->lock);
  int rc = CP_OK;
  cp_block_t *b = ptr != NULL ? cp_ptrmap_get(&pool->live, (uintptr_t)ptr) : NULL;
  if (b == NULL) {
    rc = cp_set_error(CP_ERR_INVALID, "cp_record_stream: %p is not a live allocation of this pool", ptr);
  } else {
    if (pool->backend.stream_resolve != NULL) rc = pool->backend.stream_resolve(pool->backend.ctx, stream, &stream);
    if (rc == CP_OK) rc = cp_streams_record_use_locked(b, stream);
  }
  CP_DEBUG_CHECK(pool, "cp_record_stream");
  pthread_mutex_unlock(&pool->lock);
  return rc;
}

int cp_empty_cache(cp_pool_t *pool) {
  if (pool == NULL) return cp_set_error(CP_ERR_INVALID, "cp_empty_cache: NULL pool");
  pthread_mutex_lock(&pool->lock);
  if (pool->capture.windows != 0) { /* nothing goes back during a capture */
    pthread_mutex_unlock(&pool->lock);
    return CP_OK;
  }
  if (pool->capture.deferred_count != 0) cp_capture_flush_locked(pool);
  /* A plan none of whose blocks is in use gives its range back, and is learned again. */
  if (pool->plan.bins != NULL && pool->plan.live == 0) cp_plan_give_up_locked(pool);
  int rc = CP_OK;
  if (pool->paged) {
    /* Waits for nothing (Note [Stream-ordered release]): completed frees come back, free
     * memory is retired and what its streams have finished with is unmapped now, the rest by a
     * later call. */
    if (pool->streams.pending_entries != 0) rc = cp_reclaim_completed_locked(pool);
    int rc2 = cp_segment_release_free_locked(pool);
    if (rc == CP_OK) rc = rc2;
    rc2 = cp_drain_retire_all_locked(pool);
    if (rc == CP_OK) rc = rc2;
    rc2 = cp_drain_reap_all_locked(pool, false);
    if (rc == CP_OK) rc = rc2;
  } else {
    /* As the built-in allocator: wait for pending frees, give back free segments (cudaFree
     * itself waits for the device). */
    rc = cp_synchronize_pending_locked(pool);
    int rc2 = cp_segment_release_free_locked(pool);
    if (rc == CP_OK) rc = rc2;
  }
  CP_DEBUG_CHECK(pool, "cp_empty_cache");
  pthread_mutex_unlock(&pool->lock);
  return rc;
}

int cp_pool_set_memory_cap(cp_pool_t *pool, size_t bytes) {
  if (pool == NULL) return cp_set_error(CP_ERR_INVALID, "cp_pool_set_memory_cap: NULL pool");
  pthread_mutex_lock(&pool->lock);
  pool->cfg.memory_cap = bytes;
  pool->cap_bytes = cp_effective_cap(&pool->cfg, pool->device_total);
  pthread_mutex_unlock(&pool->lock);
  return CP_OK;
}

int cp_check_memory_fraction(double fraction) {
  if (!(fraction >= 0.0 && fraction <= 1.0)) {
    return cp_set_error(CP_ERR_INVALID, "memory fraction %g is outside [0, 1]", fraction);
  }
  return CP_OK;
}

int cp_pool_set_memory_fraction(cp_pool_t *pool, double fraction) {
  if (pool == NULL) return cp_set_error(CP_ERR_INVALID, "cp_pool_set_memory_fraction: NULL pool");
  if (cp_check_memory_fraction(fraction) != CP_OK) return CP_ERR_INVALID;
  size_t dev_free = 0, dev_total = 0;
  int rc = pool->backend.mem_info(pool->backend.ctx, &dev_free, &dev_total);
  pthread_mutex_lock(&pool->lock);
  if (rc == CP_OK) pool->device_total = dev_total;
  if (fraction > 0 && pool->device_total == 0) {
    rc = cp_set_error(CP_ERR_BACKEND, "memory fraction: the device's total memory is unknown (%s)", cp_last_error());
  } else {
    rc = CP_OK;
    pool->cfg.memory_fraction = fraction;
    pool->cap_bytes = cp_effective_cap(&pool->cfg, pool->device_total);
  }
  pthread_mutex_unlock(&pool->lock);
  return rc;
}

int cp_pool_capture_begin(cp_pool_t *pool) {
  if (pool == NULL) return cp_set_error(CP_ERR_INVALID, "cp_pool_capture_begin: NULL pool");
  pthread_mutex_lock(&pool->lock);
  pool->capture.windows++;
  pthread_mutex_unlock(&pool->lock);
  return CP_OK;
}

int cp_pool_capture_end(cp_pool_t *pool) {
  if (pool == NULL) return cp_set_error(CP_ERR_INVALID, "cp_pool_capture_end: NULL pool");
  pthread_mutex_lock(&pool->lock);
  int rc = CP_OK;
  if (pool->capture.windows == 0) {
    rc = cp_set_error(CP_ERR_STATE, "cp_pool_capture_end: no capture window is open");
  } else if (--pool->capture.windows == 0 && pool->capture.deferred_count != 0) {
    cp_capture_flush_locked(pool);
  }
  CP_DEBUG_CHECK(pool, "cp_pool_capture_end");
  pthread_mutex_unlock(&pool->lock);
  return rc;
}

void cp_pool_capture_state(cp_pool_t *pool, unsigned *out_windows, size_t *out_deferred_frees) {
  pthread_mutex_lock(&pool->lock);
  if (out_windows != NULL) *out_windows = pool->capture.windows;
  if (out_deferred_frees != NULL) *out_deferred_frees = pool->capture.deferred_count;
  pthread_mutex_unlock(&pool->lock);
}
