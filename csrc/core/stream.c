/* stream.c — stream ordering: per-stream state, pooled events and the queues of frees that
 * wait for other streams. Owns: when a PENDING block may become FREE again. */
#include <stdlib.h>

#include "core/cp_internal.h"

/* Note [Stream ordering]
 * A block belongs to the stream it was allocated on and is reused only there: work queued on
 * that stream after the free is ordered after every earlier use, so no event is needed for a
 * plain free. When the user declared other streams (record_stream), the free records one event
 * on each of them and the block stays PENDING until all have completed. Events recorded on one
 * stream complete in order, so each stream keeps a FIFO and polling stops at the first event
 * not yet done. Polling never blocks; synchronizing (on the OOM path) happens without the
 * pool lock, on entries detached from the queues. */

cp_stream_state_t *cp_stream_get_locked(cp_pool_t *pool, cp_stream_t stream) {
  cp_stream_state_t *st = pool->last_stream;
  if (st != NULL && st->handle == stream) return st;
  st = cp_ptrmap_get(&pool->streams, stream);
  if (st == NULL) {
    if (pool->stream_count == pool->stream_list_cap) {
      size_t cap = pool->stream_list_cap ? pool->stream_list_cap * 2 : 8;
      cp_stream_state_t **list = realloc(pool->stream_list, cap * sizeof *list);
      if (list == NULL) {
        cp_set_error(CP_ERR_HOST_OOM, "cudapool: no host memory for stream state");
        return NULL;
      }
      pool->stream_list = list;
      pool->stream_list_cap = cap;
    }
    st = calloc(1, sizeof *st);
    if (st == NULL || cp_ptrmap_insert(&pool->streams, stream, st) != CP_OK) {
      free(st);
      cp_set_error(CP_ERR_HOST_OOM, "cudapool: no host memory for stream state");
      return NULL;
    }
    st->handle = stream;
    pool->stream_list[pool->stream_count++] = st;
  }
  pool->last_stream = st;
  return st;
}

void cp_streams_destroy_locked(cp_pool_t *pool) {
  for (size_t i = 0; i < pool->stream_count; i++) {
    cp_stream_state_t *st = pool->stream_list[i];
    for (size_t k = 0; k < st->queue_len; k++) {
      cp_event_t ev = st->queue[(st->queue_head + k) & (st->queue_cap - 1)].event;
      pool->backend.event_destroy(pool->backend.ctx, ev);
      pool->events_created--;
    }
    free(st->queue);
    free(st);
  }
  free(pool->stream_list);
  pool->stream_list = NULL;
  pool->stream_count = 0;
  pool->stream_list_cap = 0;
  pool->last_stream = NULL;
  pool->pending_entries = 0;
  for (size_t i = 0; i < pool->spare_event_count; i++) {
    pool->backend.event_destroy(pool->backend.ctx, pool->spare_events[i]);
    pool->events_created--;
  }
  free(pool->spare_events);
  pool->spare_events = NULL;
  pool->spare_event_count = 0;
  pool->spare_event_cap = 0;
}

int cp_event_acquire_locked(cp_pool_t *pool, cp_event_t *out_event) {
  if (pool->spare_event_count > 0) {
    *out_event = pool->spare_events[--pool->spare_event_count];
    return CP_OK;
  }
  int rc = pool->backend.event_create(pool->backend.ctx, out_event);
  if (rc == CP_OK) pool->events_created++;
  return rc;
}

void cp_event_release_locked(cp_pool_t *pool, cp_event_t event) {
  if (pool->spare_event_count == pool->spare_event_cap) {
    size_t cap = pool->spare_event_cap ? pool->spare_event_cap * 2 : 16;
    cp_event_t *spares = realloc(pool->spare_events, cap * sizeof *spares);
    if (spares == NULL) {
      /* No room to keep it: give it back to the device instead. */
      pool->backend.event_destroy(pool->backend.ctx, event);
      pool->events_created--;
      return;
    }
    pool->spare_events = spares;
    pool->spare_event_cap = cap;
  }
  pool->spare_events[pool->spare_event_count++] = event;
}

int cp_stream_queue_push_locked(cp_pool_t *pool, cp_stream_state_t *st, cp_event_t event, cp_block_t *block) {
  if (st->queue_len == st->queue_cap) {
    size_t cap = st->queue_cap ? st->queue_cap * 2 : 8;
    cp_pending_t *q = malloc(cap * sizeof *q);
    if (q == NULL) return cp_set_error(CP_ERR_HOST_OOM, "cudapool: no host memory for the event queue");
    for (size_t k = 0; k < st->queue_len; k++) q[k] = st->queue[(st->queue_head + k) & (st->queue_cap - 1)];
    free(st->queue);
    st->queue = q;
    st->queue_head = 0;
    st->queue_cap = cap;
  }
  st->queue[(st->queue_head + st->queue_len) & (st->queue_cap - 1)] = (cp_pending_t){event, block, st};
  st->queue_len++;
  pool->pending_entries++;
  return CP_OK;
}

cp_event_t cp_stream_queue_pop_newest_locked(cp_pool_t *pool, cp_stream_state_t *st) {
  st->queue_len--;
  pool->pending_entries--;
  return st->queue[(st->queue_head + st->queue_len) & (st->queue_cap - 1)].event;
}

void cp_pending_done_locked(cp_pool_t *pool, cp_pending_t *entry) {
  cp_event_release_locked(pool, entry->event);
  cp_block_t *b = entry->block;
  if (--b->pending_events == 0) {
    pool->pending_blocks--;
    pool->pending_bytes -= b->size;
    cp_block_release_locked(pool, b);
  }
}

int cp_streams_poll_locked(cp_pool_t *pool) {
  if (pool->pending_entries == 0) return CP_OK;
  for (size_t i = 0; i < pool->stream_count; i++) {
    cp_stream_state_t *st = pool->stream_list[i];
    while (st->queue_len > 0) {
      cp_pending_t entry = st->queue[st->queue_head];
      int done = 0;
      int rc = pool->backend.event_query(pool->backend.ctx, entry.event, &done);
      if (rc != CP_OK) return rc; /* leave it queued; the next poll asks again */
      if (!done) break;
      st->queue_head = (st->queue_head + 1) & (st->queue_cap - 1);
      st->queue_len--;
      pool->pending_entries--;
      cp_pending_done_locked(pool, &entry);
    }
  }
  return CP_OK;
}

int cp_streams_take_all_locked(cp_pool_t *pool, cp_pending_t **out_entries, size_t *out_len) {
  *out_entries = NULL;
  *out_len = 0;
  if (pool->pending_entries == 0) return CP_OK;
  cp_pending_t *all = malloc(pool->pending_entries * sizeof *all);
  if (all == NULL) return cp_set_error(CP_ERR_HOST_OOM, "cudapool: no host memory to synchronize events");
  size_t n = 0;
  for (size_t i = 0; i < pool->stream_count; i++) {
    cp_stream_state_t *st = pool->stream_list[i];
    for (size_t k = 0; k < st->queue_len; k++) all[n++] = st->queue[(st->queue_head + k) & (st->queue_cap - 1)];
    st->queue_head = 0;
    st->queue_len = 0;
  }
  pool->pending_entries = 0;
  pool->detached_entries += n;
  *out_entries = all;
  *out_len = n;
  return CP_OK;
}
