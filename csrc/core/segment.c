/* segment.c — plain segments: memory reserved from the backend one segment at a time (a
 * cudaMalloc each), served by best fit within the size rules (core/sizes.h), given back whole
 * once wholly free. Owns: growth of plain pools, garbage collection and the giving back of
 * free segments. */
#include <stdlib.h>

#include "core/history.h"
#include "core/segment.h"
#include "core/snapshot.h"

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
    CP_SEGMENT_EVENT(pool, CP_HIST_SEGMENT_FREE, seg->addr, seg->size, seg->stream->handle);
    cp_block_delete_locked(pool, seg->head);
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

int cp_segment_release_free_locked(cp_pool_t *pool) {
  cp_segment_t *list = NULL;
  cp_free_segments_detach_locked(pool, 0, &list);
  return cp_release_segments_locked(pool, list);
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
  CP_SEGMENT_EVENT(pool, CP_HIST_SEGMENT_ALLOC, seg->addr, seg->size, st->handle);
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
  *out_ptr = cp_segment_take_locked(pool, head, size, requested);
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
    cp_free_segments_detach_locked(pool, after - pool->high_water, &list);
    cp_release_segments_locked(pool, list);
    return;
  }
  double threshold = pool->cfg.garbage_collection_threshold;
  size_t limit = pool->cap_bytes != 0 ? pool->cap_bytes : pool->device_total;
  if (threshold <= 0 || limit == 0) return;
  size_t target = (size_t)(threshold * (double)limit);
  if (after <= target) return;
  cp_segment_t *list = NULL;
  cp_free_segments_detach_locked(pool, after - target, &list);
  cp_release_segments_locked(pool, list);
}

int cp_segment_grow_locked(cp_pool_t *pool, cp_stream_state_t *st, int kind, size_t rounded, size_t size,
                           size_t seg_size, bool collect, void **out_ptr) {
  if (collect) cp_collect_garbage_locked(pool, seg_size);
  return cp_grow_locked(pool, st, kind, rounded, size, seg_size, out_ptr);
}
