/* stream.c — stream ordering: per-stream state, pooled events, and the whole PENDING lifecycle.
 * Owns: when a freed block must wait for other streams, and when it may be reused again. */
#include <stdlib.h>
#include <string.h>

#include "core/stream.h"

/* Note [Stream ordering]
 * A block belongs to the stream it was allocated on and is reused only there: work queued on
 * that stream after the free is ordered after every earlier use, so no event is needed for a
 * plain free. When the user declared other streams (record_stream), the free records one event
 * on each of them and the block stays PENDING until all have completed. Events recorded on one
 * stream complete in order, so each stream keeps a FIFO and polling stops at the first event
 * not yet done. Polling never blocks; synchronizing (on the OOM path and in empty_cache)
 * happens without the pool lock, on entries detached from the queues. Completed blocks go
 * back to the pool as a list (cp_done_list_t): this file never calls into pool.c. */

/* ------------------------------------------------------------------------------------------
 * Stream states
 * ---------------------------------------------------------------------------------------- */

int cp_streams_init(cp_streams_t *ss, const cp_backend_t *backend) {
  memset(ss, 0, sizeof *ss);
  ss->backend = backend;
  return cp_ptrmap_init(&ss->map, 16);
}

static void cp_event_destroy(cp_streams_t *ss, cp_event_t event) {
  ss->backend->event_destroy(ss->backend->ctx, event);
  ss->events_created--;
}

void cp_streams_drop_backups(cp_streams_t *ss, cp_stream_state_t *st) {
  for (size_t i = 0; i < st->backup_count; i++) (void)ss->backend->host_free(ss->backend->ctx, st->backups[i].host);
  free(st->backups);
  st->backups = NULL;
  st->backup_count = 0;
  st->backup_bytes = 0;
}

void cp_streams_destroy(cp_streams_t *ss) {
  for (size_t i = 0; i < ss->count; i++) {
    cp_stream_state_t *st = ss->list[i];
    cp_streams_drop_backups(ss, st);
    for (size_t k = 0; k < st->queue_len; k++) {
      cp_event_destroy(ss, st->queue[(st->queue_head + k) & (st->queue_cap - 1)].event);
    }
    free(st->queue);
    free(st);
  }
  free(ss->list);
  for (size_t i = 0; i < ss->spare_event_count; i++) cp_event_destroy(ss, ss->spare_events[i]);
  free(ss->spare_events);
  cp_ptrmap_destroy(&ss->map);
  const cp_backend_t *backend = ss->backend;
  memset(ss, 0, sizeof *ss);
  ss->backend = backend;
}

/* A new state of (stream, tag) on the list; untagged ones go into `map` too. NULL when host
 * memory ran out (nothing changed). */
static cp_stream_state_t *cp_streams_add_locked(cp_streams_t *ss, cp_stream_t stream, uint32_t tag) {
  if (ss->count == ss->list_cap) {
    size_t cap = ss->list_cap ? ss->list_cap * 2 : 8;
    cp_stream_state_t **list = realloc(ss->list, cap * sizeof *list);
    if (list == NULL) {
      cp_set_error(CP_ERR_HOST_OOM, "cudapool: no host memory for stream state");
      return NULL;
    }
    ss->list = list;
    ss->list_cap = cap;
  }
  cp_stream_state_t *st = calloc(1, sizeof *st);
  if (st == NULL || (tag == 0 && cp_ptrmap_insert(&ss->map, stream, st) != CP_OK)) {
    free(st);
    cp_set_error(CP_ERR_HOST_OOM, "cudapool: no host memory for stream state");
    return NULL;
  }
  st->handle = stream;
  st->tag = tag;
  ss->list[ss->count++] = st;
  return st;
}

cp_stream_state_t *cp_streams_lookup_locked(cp_streams_t *ss, cp_stream_t stream) {
  cp_stream_state_t *st = cp_ptrmap_get(&ss->map, stream);
  if (st == NULL) st = cp_streams_add_locked(ss, stream, 0);
  if (st != NULL) ss->last = st;
  return st;
}

cp_stream_state_t *cp_streams_get_tagged_locked(cp_streams_t *ss, cp_stream_t stream, uint32_t tag) {
  for (size_t i = 0; i < ss->count; i++) {
    cp_stream_state_t *st = ss->list[i];
    if (st->tag == tag && st->handle == stream) return st;
  }
  return cp_streams_add_locked(ss, stream, tag);
}

int cp_streams_record_use_locked(cp_block_t *b, cp_stream_t stream) {
  if (stream == b->segment->stream->handle) return CP_OK; /* the allocation stream orders itself */
  for (uint32_t i = 0; i < b->use_count; i++) {
    if (b->uses[i] == stream) return CP_OK;
  }
  if (b->use_count == b->use_cap) {
    uint32_t cap = b->use_cap ? b->use_cap * 2 : 4;
    cp_stream_t *uses = realloc(b->uses, cap * sizeof *uses);
    if (uses == NULL) return cp_set_error(CP_ERR_HOST_OOM, "cp_record_stream: no host memory");
    b->uses = uses;
    b->use_cap = cap;
  }
  b->uses[b->use_count++] = stream;
  return CP_OK;
}

/* ------------------------------------------------------------------------------------------
 * Pooled events and the per-stream queues
 * ---------------------------------------------------------------------------------------- */

/* stream.h: take an event from the spares, creating one when there is none. */
int cp_streams_event_acquire_locked(cp_streams_t *ss, cp_event_t *out_event) {
  if (ss->spare_event_count > 0) {
    *out_event = ss->spare_events[--ss->spare_event_count];
    return CP_OK;
  }
  int rc = ss->backend->event_create(ss->backend->ctx, out_event);
  if (rc == CP_OK) ss->events_created++;
  return rc;
}

void cp_streams_event_release_locked(cp_streams_t *ss, cp_event_t event) {
  if (ss->spare_event_count == ss->spare_event_cap) {
    size_t cap = ss->spare_event_cap ? ss->spare_event_cap * 2 : 16;
    cp_event_t *spares = realloc(ss->spare_events, cap * sizeof *spares);
    if (spares == NULL) {
      cp_event_destroy(ss, event); /* no room to keep it: give it back to the device instead */
      return;
    }
    ss->spare_events = spares;
    ss->spare_event_cap = cap;
  }
  ss->spare_events[ss->spare_event_count++] = event;
}

static int cp_queue_push_locked(cp_streams_t *ss, cp_stream_state_t *st, cp_event_t event, cp_block_t *block) {
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
  ss->pending_entries++;
  return CP_OK;
}

/* Drop the newest entry of st's queue (undo of a push), returning its event. */
static cp_event_t cp_queue_pop_newest_locked(cp_streams_t *ss, cp_stream_state_t *st) {
  st->queue_len--;
  ss->pending_entries--;
  return st->queue[(st->queue_head + st->queue_len) & (st->queue_cap - 1)].event;
}

/* One event of a PENDING block completed: keep the event, and hand the block back when it
 * was the last one it waited for. */
static void cp_pending_done_locked(cp_streams_t *ss, const cp_pending_t *entry, cp_done_list_t *done) {
  cp_streams_event_release_locked(ss, entry->event);
  cp_block_t *b = entry->block;
  if (--b->pending_events != 0) return;
  ss->pending_blocks--;
  ss->pending_bytes -= b->size;
  b->left = NULL;
  if (done->tail != NULL)
    done->tail->left = b;
  else
    done->head = b;
  done->tail = b;
}

/* ------------------------------------------------------------------------------------------
 * The lifecycle: LIVE -> PENDING (defer_free) -> handed back (poll, synchronize)
 * ---------------------------------------------------------------------------------------- */

int cp_streams_defer_free_locked(cp_streams_t *ss, cp_block_t *b) {
  uint32_t i;
  int rc = CP_OK;
  cp_stream_state_t *pushed[64];
  for (i = 0; i < b->use_count; i++) {
    cp_stream_state_t *st = cp_streams_get_locked(ss, b->uses[i]);
    cp_event_t ev = 0;
    if (st == NULL) {
      rc = CP_ERR_HOST_OOM;
      break;
    }
    rc = cp_streams_event_acquire_locked(ss, &ev);
    if (rc != CP_OK) break;
    rc = ss->backend->event_record(ss->backend->ctx, ev, b->uses[i]);
    if (rc == CP_OK) rc = cp_queue_push_locked(ss, st, ev, b);
    if (rc != CP_OK) {
      cp_streams_event_release_locked(ss, ev);
      break;
    }
    if (i < 64) pushed[i] = st;
  }
  if (rc != CP_OK) { /* undo: the newest entry of each touched stream is ours */
    while (i-- > 0) {
      cp_stream_state_t *st = i < 64 ? pushed[i] : cp_streams_get_locked(ss, b->uses[i]);
      cp_streams_event_release_locked(ss, cp_queue_pop_newest_locked(ss, st));
    }
    return rc;
  }
  b->state = CP_BLOCK_PENDING;
  b->pending_events = b->use_count;
  ss->pending_blocks++;
  ss->pending_bytes += b->size;
  return CP_OK;
}

int cp_streams_poll_locked(cp_streams_t *ss, cp_done_list_t *done) {
  if (ss->pending_entries == 0) return CP_OK;
  for (size_t i = 0; i < ss->count; i++) {
    cp_stream_state_t *st = ss->list[i];
    while (st->queue_len > 0) {
      cp_pending_t entry = st->queue[st->queue_head];
      int is_done = 0;
      int rc = ss->backend->event_query(ss->backend->ctx, entry.event, &is_done);
      if (rc != CP_OK) return rc; /* leave it queued; the next poll asks again */
      if (!is_done) break;
      st->queue_head = (st->queue_head + 1) & (st->queue_cap - 1);
      st->queue_len--;
      ss->pending_entries--;
      cp_pending_done_locked(ss, &entry, done);
    }
  }
  return CP_OK;
}

/* Detach every queued entry into an array owned by the caller (*out_len entries); the blocks
 * stay PENDING, counted in detached_entries. */
static int cp_streams_take_all_locked(cp_streams_t *ss, cp_pending_t **out_entries, size_t *out_len) {
  *out_entries = NULL;
  *out_len = 0;
  if (ss->pending_entries == 0) return CP_OK;
  cp_pending_t *all = malloc(ss->pending_entries * sizeof *all);
  if (all == NULL) return cp_set_error(CP_ERR_HOST_OOM, "cudapool: no host memory to synchronize events");
  size_t n = 0;
  for (size_t i = 0; i < ss->count; i++) {
    cp_stream_state_t *st = ss->list[i];
    for (size_t k = 0; k < st->queue_len; k++) all[n++] = st->queue[(st->queue_head + k) & (st->queue_cap - 1)];
    st->queue_head = 0;
    st->queue_len = 0;
  }
  ss->pending_entries = 0;
  ss->detached_entries += n;
  *out_entries = all;
  *out_len = n;
  return CP_OK;
}

/* An event the device failed to wait for goes back on its stream's queue: its block is not
 * known to be done, so it must not be reused (polling will ask again). Should even that fail
 * for want of host memory, the entry stays detached and its block is never reused. */
int cp_streams_synchronize_locked(cp_streams_t *ss, pthread_mutex_t *lock, cp_done_list_t *done, bool *out_waited) {
  *out_waited = false;
  cp_pending_t *entries;
  size_t n;
  int rc = cp_streams_take_all_locked(ss, &entries, &n);
  if (rc != CP_OK || n == 0) return rc;
  unsigned char *ok = calloc(n, 1);
  int first_rc = ok != NULL ? CP_OK : cp_set_error(CP_ERR_HOST_OOM, "cudapool: no host memory to synchronize events");
  if (ok != NULL) {
    *out_waited = true;
    pthread_mutex_unlock(lock);
    for (size_t i = 0; i < n; i++) {
      int r = ss->backend->event_synchronize(ss->backend->ctx, entries[i].event);
      ok[i] = r == CP_OK;
      if (r != CP_OK && first_rc == CP_OK) first_rc = r;
    }
    pthread_mutex_lock(lock);
  }
  for (size_t i = 0; i < n; i++) {
    cp_pending_t *e = &entries[i];
    if (ok != NULL && ok[i]) {
      ss->detached_entries--;
      cp_pending_done_locked(ss, e, done);
    } else if (cp_queue_push_locked(ss, e->stream, e->event, e->block) == CP_OK) {
      ss->detached_entries--;
    }
  }
  free(ok);
  free(entries);
  return first_rc;
}
