/* pool.c — the pool's policy: size classes, best fit, split and merge, growth, the OOM
 * ladder and empty_cache. Owns: segments, blocks and the pool lock. */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "core/cp_internal.h"
#include "core/sizes.h"

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
 * Block nodes
 * ---------------------------------------------------------------------------------------- */

/* Make sure `n` spare block nodes and room for one more live block exist, so that the rest
 * of an operation cannot fail half-way. */
int cp_reserve_metadata_locked(cp_pool_t *pool, int n) {
  if (n == 1 && pool->spare_blocks != NULL && (pool->live.count + 1) * 2 <= pool->live.mask + 1) {
    return CP_OK; /* the common case, without walking or calling out */
  }
  int have = 0;
  for (cp_block_t *b = pool->spare_blocks; b != NULL && have < n; b = b->left) have++;
  if (have < n) {
    cp_block_slab_t *slab = calloc(1, sizeof *slab);
    if (slab == NULL) return cp_set_error(CP_ERR_HOST_OOM, "cudapool: no host memory for block metadata");
    slab->next = pool->slabs;
    pool->slabs = slab;
    for (int i = CP_BLOCK_SLAB - 1; i >= 0; i--) {
      slab->blocks[i].left = pool->spare_blocks;
      pool->spare_blocks = &slab->blocks[i];
    }
  }
  return cp_ptrmap_reserve(&pool->live, 1);
}

cp_block_t *cp_block_new_locked(cp_pool_t *pool) {
  cp_block_t *b = pool->spare_blocks; /* guaranteed by cp_reserve_metadata_locked */
  pool->spare_blocks = b->left;
  memset(b, 0, sizeof *b);
  return b;
}

cp_block_t *cp_segment_head_locked(cp_pool_t *pool, cp_segment_t *seg, cp_block_state_t state) {
  cp_block_t *head = cp_block_new_locked(pool);
  head->addr = seg->addr;
  head->size = seg->size;
  head->segment = seg;
  head->state = (uint8_t)state;
  seg->head = head;
  return head;
}

static inline void cp_block_delete_impl(cp_pool_t *pool, cp_block_t *b) {
  if (b->uses != NULL) {
    free(b->uses);
    b->uses = NULL;
  }
  b->left = pool->spare_blocks;
  pool->spare_blocks = b;
}

/* Index insert/remove that keep the inactive_split stats: a FREE block counts there when it
 * is only part of its segment. A block's split-ness changes only while it is out of the
 * index, so counting at these two points is exact. */
/* The list of wholly free segments: a segment is on it exactly while its one block is FREE
 * and in the index, so giving back cached memory never walks the segments in use. */
static void cp_free_segment_push_locked(cp_pool_t *pool, cp_segment_t *seg) {
  seg->free_next = NULL;
  seg->free_prev = pool->free_segments_tail;
  if (pool->free_segments_tail != NULL)
    pool->free_segments_tail->free_next = seg;
  else
    pool->free_segments_head = seg;
  pool->free_segments_tail = seg;
  seg->in_free_list = true;
  pool->free_segment_count++;
}

static void cp_free_segment_unlink_locked(cp_pool_t *pool, cp_segment_t *seg) {
  if (seg->free_prev != NULL)
    seg->free_prev->free_next = seg->free_next;
  else
    pool->free_segments_head = seg->free_next;
  if (seg->free_next != NULL)
    seg->free_next->free_prev = seg->free_prev;
  else
    pool->free_segments_tail = seg->free_prev;
  seg->free_prev = seg->free_next = NULL;
  seg->in_free_list = false;
  pool->free_segment_count--;
}

void cp_free_insert_locked(cp_pool_t *pool, cp_block_t *b) {
  cp_segment_t *seg = b->segment;
  cp_index_insert(&seg->stream->index[seg->kind], b);
  if (cp_block_is_split(b)) {
    cp_stats_inc(&pool->stats, CP_STAT_INACTIVE_SPLIT, seg->kind, 1);
    cp_stats_inc(&pool->stats, CP_STAT_INACTIVE_SPLIT_BYTES, seg->kind, b->size);
  } else {
    cp_free_segment_push_locked(pool, seg);
  }
}

static void cp_free_removed_locked(cp_pool_t *pool, cp_block_t *b) {
  if (cp_block_is_split(b)) {
    cp_stats_dec(&pool->stats, CP_STAT_INACTIVE_SPLIT, b->segment->kind, 1);
    cp_stats_dec(&pool->stats, CP_STAT_INACTIVE_SPLIT_BYTES, b->segment->kind, b->size);
  } else {
    cp_free_segment_unlink_locked(pool, b->segment);
  }
}

static inline void cp_free_remove_impl(cp_pool_t *pool, cp_block_t *b) {
  cp_segment_t *seg = b->segment;
  cp_index_remove(&seg->stream->index[seg->kind], b);
  cp_free_removed_locked(pool, b);
}

void cp_block_delete_locked(cp_pool_t *pool, cp_block_t *b) { cp_block_delete_impl(pool, b); }
void cp_free_remove_locked(cp_pool_t *pool, cp_block_t *b) { cp_free_remove_impl(pool, b); }

/* ------------------------------------------------------------------------------------------
 * Taking and returning blocks
 * ---------------------------------------------------------------------------------------- */

/* Best fit on (stream, kind), within the oversize rules (cp_size_fits). The block found leaves
 * the index. */
static cp_block_t *cp_take_free_locked(cp_pool_t *pool, cp_stream_state_t *st, int kind, size_t size) {
  cp_block_t **link;
  cp_block_t *b = cp_index_lower_bound_link(&st->index[kind], size, &link);
  if (b == NULL || !cp_size_fits(&pool->cfg, size, b->size)) return NULL;
  cp_index_remove_at(&st->index[kind], link);
  cp_free_removed_locked(pool, b);
  return b;
}

/* The body of cp_block_make_live_locked, inlined on the allocation path. */
static inline void cp_block_make_live_inline(cp_pool_t *pool, cp_block_t *b, size_t requested) {
  int kind = b->segment->kind;
  b->state = CP_BLOCK_LIVE;
  b->requested = requested;
  cp_ptrmap_insert(&pool->live, b->addr, b); /* room reserved: cannot fail */
  cp_stats_t *st = &pool->stats;
  cp_stats_inc(st, CP_STAT_ALLOCATION, kind, 1);
  cp_stats_inc(st, CP_STAT_ALLOCATED_BYTES, kind, b->size);
  cp_stats_inc(st, CP_STAT_ACTIVE, kind, 1);
  cp_stats_inc(st, CP_STAT_ACTIVE_BYTES, kind, b->size);
  cp_stats_inc(st, CP_STAT_REQUESTED_BYTES, kind, requested);
  if (b->size >= pool->cfg.max_split_size) cp_stat_inc(&st->oversize_allocations, 1);
}

/* Hand the FREE block `b` (not in the index) to the user for a request of `size` rounded
 * bytes (`requested` asked). Needs one spare node and live-map room (reserved earlier). */
static void *cp_take_locked(cp_pool_t *pool, cp_block_t *b, size_t size, size_t requested) {
  const cp_config_t *cfg = &pool->cfg;
  int kind = b->segment->kind;
  size_t remaining = b->size - size;
  if (remaining > 0 && cp_size_should_split(cfg, kind, size, remaining)) {
    cp_free_insert_locked(pool, cp_block_cut_locked(pool, b, size)); /* b is FREE: so is the rest */
  }
  cp_block_make_live_inline(pool, b, requested);
  return (void *)b->addr;
}

void cp_block_make_live_locked(cp_pool_t *pool, cp_block_t *b, size_t requested) {
  cp_block_make_live_inline(pool, b, requested);
}

static inline void cp_block_merge_free_impl(cp_pool_t *pool, cp_block_t *b);

/* Return a PENDING or LIVE block to the free index: merge with free neighbours, update
 * active/inactive stats. */
static void cp_block_release_locked(cp_pool_t *pool, cp_block_t *b) {
  int kind = b->segment->kind;
  cp_stats_dec(&pool->stats, CP_STAT_ACTIVE, kind, 1);
  cp_stats_dec(&pool->stats, CP_STAT_ACTIVE_BYTES, kind, b->size);
  cp_stats_dec(&pool->stats, CP_STAT_REQUESTED_BYTES, kind, b->requested);
  b->requested = 0;
  b->use_count = 0;
  if (b->segment->stitched) {
    cp_stitch_release_locked(pool, b); /* kept for reuse, its pages back to their segments */
    return;
  }
  cp_block_merge_free_impl(pool, b);
}

void cp_block_merge_free_locked(cp_pool_t *pool, cp_block_t *b) { cp_block_merge_free_impl(pool, b); }

static inline void cp_block_merge_free_impl(cp_pool_t *pool, cp_block_t *b) {
  b->state = CP_BLOCK_FREE;
  cp_block_t *p = b->prev;
  if (p != NULL && p->state == CP_BLOCK_FREE) { /* absorb b into its lower neighbour */
    cp_free_remove_impl(pool, p);
    cp_block_delete_impl(pool, cp_block_absorb_next(p));
    b = p;
  }
  cp_block_t *n = b->next;
  if (n != NULL && n->state == CP_BLOCK_FREE) { /* absorb the upper neighbour */
    cp_free_remove_impl(pool, n);
    cp_block_delete_impl(pool, cp_block_absorb_next(b));
  }
  cp_free_insert_locked(pool, b);
}

/* ------------------------------------------------------------------------------------------
 * Segments
 * ---------------------------------------------------------------------------------------- */

/* Reserved, plus what is being reserved right now without the lock: what growth counts. */
size_t cp_held_locked(const cp_pool_t *pool) { return cp_reserved_locked(pool) + pool->inflight_bytes; }

static void cp_segment_stats_locked(cp_pool_t *pool, const cp_segment_t *seg, int sign) {
  cp_stats_update(&pool->stats, CP_STAT_SEGMENT, seg->kind, sign);
  cp_stats_update(&pool->stats, CP_STAT_RESERVED_BYTES, seg->kind, sign * (int64_t)seg->size);
  if (seg->size >= pool->cfg.max_split_size) cp_stat_add(&pool->stats.oversize_segments, sign);
}

void cp_segment_link_locked(cp_pool_t *pool, cp_segment_t *seg) {
  seg->prev = NULL;
  seg->next = pool->segments;
  if (pool->segments != NULL) pool->segments->prev = seg;
  pool->segments = seg;
  pool->segment_count++;
  if (!seg->paged) cp_segment_stats_locked(pool, seg, +1); /* paged: mapped bytes count, not segments */
}

void cp_segment_unlink_locked(cp_pool_t *pool, cp_segment_t *seg) {
  if (seg->prev != NULL)
    seg->prev->next = seg->next;
  else
    pool->segments = seg->next;
  if (seg->next != NULL) seg->next->prev = seg->prev;
  pool->segment_count--;
  if (!seg->paged) cp_segment_stats_locked(pool, seg, -1);
}

/* Take wholly free segments out of the pool (oldest first) until `want_bytes` are gathered
 * (0 = all). They are chained through `next` into *out_list; stats already exclude them. */
static size_t cp_detach_free_segments_locked(cp_pool_t *pool, size_t want_bytes, cp_segment_t **out_list) {
  size_t bytes = 0;
  while (pool->free_segments_head != NULL) {
    cp_segment_t *seg = pool->free_segments_head; /* the one free the longest */
    cp_free_remove_impl(pool, seg->head);         /* also takes it off the free list */
    cp_segment_unlink_locked(pool, seg);
    seg->next = *out_list;
    *out_list = seg;
    bytes += seg->size;
    if (want_bytes != 0 && bytes >= want_bytes) break;
  }
  return bytes;
}

/* Give detached segments back to the backend. Called and returns with the lock held; drops
 * it around the release calls. A segment the backend refuses goes back into the pool. */
static int cp_release_segments_locked(cp_pool_t *pool, cp_segment_t *list) {
  if (list == NULL) return CP_OK;
  pthread_mutex_unlock(&pool->lock);
  cp_segment_t *failed = NULL;
  int first_rc = CP_OK;
  cp_segment_t *done = NULL;
  while (list != NULL) {
    cp_segment_t *seg = list;
    list = seg->next;
    int rc = pool->backend.release(pool->backend.ctx, seg->addr, seg->size);
    if (rc != CP_OK) {
      if (first_rc == CP_OK) first_rc = rc;
      seg->next = failed;
      failed = seg;
    } else {
      seg->next = done;
      done = seg;
    }
  }
  pthread_mutex_lock(&pool->lock);
  while (done != NULL) {
    cp_segment_t *seg = done;
    done = seg->next;
    pool->stats.num_device_free++;
    CP_HISTORY(pool, CP_HIST_SEGMENT_FREE, seg->addr, seg->size, seg->stream->handle);
    cp_block_delete_impl(pool, seg->head);
    free(seg);
  }
  while (failed != NULL) {
    cp_segment_t *seg = failed;
    failed = seg->next;
    cp_segment_link_locked(pool, seg);
    cp_free_insert_locked(pool, seg->head);
  }
  return first_rc;
}

int cp_release_free_segments_locked(cp_pool_t *pool) {
  cp_segment_t *list = NULL;
  cp_detach_free_segments_locked(pool, 0, &list);
  return cp_release_segments_locked(pool, list);
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

int cp_segment_reserve_locked(cp_pool_t *pool, size_t seg_size, cp_segment_t **out_seg) {
  size_t reserved = cp_held_locked(pool);
  if (pool->cap_bytes != 0 && (seg_size > pool->cap_bytes || reserved > pool->cap_bytes - seg_size)) {
    return cp_set_error(CP_ERR_OOM, "cudapool: memory cap of %zu bytes reached", pool->cap_bytes);
  }
  /* No device holds such a segment, and counting it in flight would wrap the sums. */
  if (seg_size > SIZE_MAX - reserved) {
    return cp_set_error(CP_ERR_OOM, "cudapool: a segment of %zu bytes does not fit beside the %zu reserved", seg_size,
                        reserved);
  }
  pool->inflight_bytes += seg_size;
  pthread_mutex_unlock(&pool->lock);
  uintptr_t addr = 0;
  int rc = CP_OK;
  cp_segment_t *seg = calloc(1, sizeof *seg);
  if (seg == NULL) rc = cp_set_error(CP_ERR_HOST_OOM, "cudapool: no host memory for a segment");
  if (rc == CP_OK) rc = pool->backend.reserve(pool->backend.ctx, seg_size, &addr);
  pthread_mutex_lock(&pool->lock);
  pool->inflight_bytes -= seg_size;
  if (rc != CP_OK) {
    free(seg);
    return rc;
  }
  seg->addr = addr;
  seg->size = seg_size;
  *out_seg = seg;
  return CP_OK;
}

void cp_segment_unreserve_locked(cp_pool_t *pool, cp_segment_t *seg) {
  pthread_mutex_unlock(&pool->lock);
  pool->backend.release(pool->backend.ctx, seg->addr, seg->size);
  pthread_mutex_lock(&pool->lock);
  free(seg);
}

void cp_segment_adopt_locked(cp_pool_t *pool, cp_segment_t *seg, cp_stream_state_t *st, int kind) {
  pool->stats.num_device_alloc++;
  seg->stream = st;
  seg->kind = (uint8_t)kind;
  cp_segment_link_locked(pool, seg);
  CP_HISTORY(pool, CP_HIST_SEGMENT_ALLOC, seg->addr, seg->size, st->handle);
  /* The mark moves only for memory really had: a refused request (a huge one from bad input,
   * say) must not raise it and so switch release_before_grow off for good. */
  const size_t held = cp_held_locked(pool);
  if (held > pool->high_water) pool->high_water = held;
}

/* Reserve one new segment for (st, kind) and take a block from it. Called and returns with
 * the lock held; the backend call runs without it. */
static int cp_grow_locked(cp_pool_t *pool, cp_stream_state_t *st, int kind, size_t size, size_t requested,
                          size_t seg_size, void **out_ptr) {
  cp_segment_t *seg = NULL;
  int rc = cp_segment_reserve_locked(pool, seg_size, &seg);
  if (rc != CP_OK) return rc;
  rc = cp_reserve_metadata_locked(pool, 2);
  if (rc != CP_OK) {
    cp_segment_unreserve_locked(pool, seg);
    return rc;
  }
  cp_block_t *head = cp_segment_head_locked(pool, seg, CP_BLOCK_FREE);
  cp_segment_adopt_locked(pool, seg, st, kind);
  *out_ptr = cp_take_locked(pool, head, size, requested);
  return CP_OK;
}

/* Before growing: with release_before_grow, give back every wholly free segment (none of
 * them could serve this request: the index was searched); else, past
 * garbage_collection_threshold of the limit, give back free segments until under it. */
static void cp_collect_garbage_locked(cp_pool_t *pool, size_t seg_size) {
  /* A segment that cannot even be added to what is reserved is refused by cp_grow_locked
   * (the retry then gives the cache back): nothing to compute, and nothing may wrap below. */
  const size_t held = cp_held_locked(pool);
  if (seg_size > SIZE_MAX - held) return;
  const size_t after = held + seg_size;
  if (pool->cfg.release_before_grow) {
    /* Growing below the high-water mark costs no peak: keep the cache. Past it, give back
     * (oldest first) what keeps the mark where it is, if the cache holds that much. */
    if (after <= pool->high_water) return;
    cp_segment_t *list = NULL;
    cp_detach_free_segments_locked(pool, after - pool->high_water, &list);
    cp_release_segments_locked(pool, list);
    return;
  }
  double threshold = pool->cfg.garbage_collection_threshold;
  size_t limit = pool->cap_bytes != 0 ? pool->cap_bytes : pool->device_total;
  if (threshold <= 0 || limit == 0) return;
  size_t target = (size_t)(threshold * (double)limit);
  if (after <= target) return;
  cp_segment_t *list = NULL;
  cp_detach_free_segments_locked(pool, after - target, &list);
  cp_release_segments_locked(pool, list);
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
  pool->stats.max_split_size = cfg->max_split_size == SIZE_MAX ? -1 : (int64_t)cfg->max_split_size;
  cp_clear_error();
  *out_pool = pool;
  return CP_OK;
}

void cp_pool_destroy(cp_pool_t *pool) {
  if (pool == NULL) return;
  cp_fork_unregister(&pool->fork_node); /* before the pool lock: the registry's is outer */
  pthread_mutex_lock(&pool->lock);
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

/* Note [The OOM ladder]
 * 1. best fit in the (stream, kind) index, after reclaiming frees whose events completed;
 * 2. garbage collection (when configured): give back free segments above the threshold;
 * 3. grow: reserve a new segment from the backend (within the cap);
 * 4. retry (counted in num_alloc_retries): wait for every pending free, give back every
 *    wholly free segment, then best fit and grow once more;
 * 5. fail (counted in num_ooms) with a report of where the memory is. */
int cp_alloc(cp_pool_t *pool, size_t size, cp_stream_t stream, void **out_ptr) {
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
  int rc = CP_OK;
  cp_stream_state_t *st = NULL;
  if (rounded == 0) {
    rc = CP_ERR_OOM; /* larger than any address space */
  } else if ((rc = cp_reserve_metadata_locked(pool, 1)) == CP_OK) {
    st = cp_streams_get_locked(&pool->streams, stream);
    if (st == NULL) rc = CP_ERR_HOST_OOM;
  }
  if (rc == CP_OK && pool->capture.deferred_count != 0) cp_capture_flush_locked(pool);
  if (rc == CP_OK && pool->paged) {
    rc = cp_expand_alloc_locked(pool, st, kind, rounded, size, out_ptr);
  } else if (rc == CP_OK) {
    /* 1. */
    if (pool->streams.pending_entries != 0 && !cp_capturing_locked(pool, stream)) cp_reclaim_completed_locked(pool);
    cp_block_t *b = cp_take_free_locked(pool, st, kind, rounded);
    if (b != NULL) {
      *out_ptr = cp_take_locked(pool, b, rounded, size);
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
      if (!capturing) cp_collect_garbage_locked(pool, seg_size);
      rc = cp_grow_locked(pool, st, kind, rounded, size, seg_size, out_ptr);
    }
    if (rc == CP_ERR_OOM && seg_size != 0 && !capturing) {
      /* 4. */
      pool->stats.num_alloc_retries++;
      cp_synchronize_pending_locked(pool);
      cp_segment_t *list = NULL;
      cp_detach_free_segments_locked(pool, 0, &list);
      cp_release_segments_locked(pool, list);
      rc = cp_reserve_metadata_locked(pool, 1);
      if (rc == CP_OK) {
        b = cp_take_free_locked(pool, st, kind, rounded);
        if (b != NULL) {
          *out_ptr = cp_take_locked(pool, b, rounded, size);
        } else {
          rc = cp_grow_locked(pool, st, kind, rounded, size, seg_size, out_ptr);
        }
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
  int rc = CP_OK;
  if (pool->paged) {
    /* Waits for nothing (Note [Stream-ordered release]): completed frees come back, free
     * memory is retired and what its streams have finished with is unmapped now, the rest by a
     * later call. */
    if (pool->streams.pending_entries != 0) rc = cp_reclaim_completed_locked(pool);
    int rc2 = cp_release_free_segments_locked(pool);
    if (rc == CP_OK) rc = rc2;
    rc2 = cp_drain_retire_all_locked(pool);
    if (rc == CP_OK) rc = rc2;
    rc2 = cp_drain_reap_all_locked(pool, false);
    if (rc == CP_OK) rc = rc2;
  } else {
    /* As the built-in allocator: wait for pending frees, give back free segments (cudaFree
     * itself waits for the device). */
    rc = cp_synchronize_pending_locked(pool);
    int rc2 = cp_release_free_segments_locked(pool);
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
