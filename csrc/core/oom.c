/* oom.c — what the pool held when an allocation failed, and the log of the latest events.
 * Owns: the out-of-memory record (cp_oom_info_t: taken, kept, read) and the event log ring. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/index.h"
#include "core/oom.h"
#include "core/sizes.h"

/* ------------------------------------------------------------------------------------------
 * The record
 * ---------------------------------------------------------------------------------------- */

static size_t cp_oom_unused(const cp_oom_stream_t *s) { return s->cached_free + s->pending_free; }

static void cp_oom_stream_add(cp_oom_stream_t *into, const cp_oom_stream_t *s) {
  into->cached_free += s->cached_free;
  into->free_blocks += s->free_blocks;
  if (s->largest_free_block > into->largest_free_block) into->largest_free_block = s->largest_free_block;
  into->pending_free += s->pending_free;
  into->pending_blocks += s->pending_blocks;
}

/* Keep `s` among the CP_OOM_STREAMS streams with the most unused bytes (ties: the stream seen
 * first), streams[] sorted by them, most first; what falls off is added to `other`. */
static void cp_oom_rank_stream(cp_oom_info_t *out, const cp_oom_stream_t *s) {
  size_t i = out->stream_count;
  if (i == CP_OOM_STREAMS) {
    if (cp_oom_unused(s) <= cp_oom_unused(&out->streams[i - 1])) {
      cp_oom_stream_add(&out->other, s);
      out->other_streams++;
      return;
    }
    cp_oom_stream_add(&out->other, &out->streams[i - 1]);
    out->other_streams++;
    i--;
  } else {
    out->stream_count++;
  }
  while (i > 0 && cp_oom_unused(&out->streams[i - 1]) < cp_oom_unused(s)) {
    out->streams[i] = out->streams[i - 1];
    i--;
  }
  out->streams[i] = *s;
}

/* The pool's figures now, lock held (device figures left 0). */
static void cp_oom_capture_locked(cp_pool_t *pool, size_t size, size_t rounded, cp_stream_t stream,
                                  cp_oom_info_t *out) {
  memset(out, 0, sizeof *out);
  out->device = pool->backend.device;
  out->backend = pool->backend.name;
  out->stream = stream;
  out->requested = size;
  out->rounded = rounded;
  out->reserved = cp_reserved_locked(pool);
  out->allocated = (size_t)pool->stats.family[CP_STAT_ALLOCATED_BYTES][CP_KIND_ALL].current;
  out->segments = pool->segment_count;
  out->live_blocks = pool->live.count;
  out->memory_cap = pool->cap_bytes;
  out->paused = pool->paused_bytes;
  out->num_ooms = pool->stats.num_ooms;
  out->log_event = UINT64_MAX;
  /* Each stream's share; all of them in `other` when there is no host memory to itemise. */
  const size_t n = pool->streams.count;
  cp_oom_stream_t one[16];
  cp_oom_stream_t *per = n <= 16 ? one : calloc(n, sizeof *per);
  if (per == one) memset(one, 0, sizeof one);
  for (size_t i = 0; i < n; i++) {
    const cp_stream_state_t *st = pool->streams.list[i];
    cp_oom_stream_t s = {.stream = st->handle};
    for (int k = CP_KIND_SMALL; k <= CP_KIND_LARGE; k++) {
      s.cached_free += st->index[k].bytes;
      s.free_blocks += st->index[k].count;
      const cp_block_t *big = cp_index_largest(&st->index[k]);
      if (big != NULL && big->size > s.largest_free_block) s.largest_free_block = big->size;
    }
    if (per != NULL) {
      per[i] = s;
    } else {
      cp_oom_stream_add(&out->other, &s);
    }
  }
  /* PENDING blocks go back to their segment's stream: a walk over the blocks, only here. */
  if (pool->streams.pending_blocks != 0) {
    for (const cp_segment_t *seg = pool->segments; seg != NULL; seg = seg->next) {
      for (const cp_block_t *b = seg->head; b != NULL; b = b->next) {
        if (b->state != CP_BLOCK_PENDING) continue;
        size_t i = 0;
        while (per != NULL && i < n && pool->streams.list[i] != seg->stream) i++;
        cp_oom_stream_t *s = per != NULL && i < n ? &per[i] : &out->other;
        s->pending_free += b->size;
        s->pending_blocks++;
      }
    }
  }
  if (per != NULL) {
    for (size_t i = 0; i < n; i++) cp_oom_rank_stream(out, &per[i]);
    if (per != one) free(per);
  } else {
    out->other_streams = n;
  }
  cp_oom_stream_t total = out->other;
  for (size_t i = 0; i < out->stream_count; i++) cp_oom_stream_add(&total, &out->streams[i]);
  /* Retired memory waiting for its stream (drain.c) is cached too, though not reusable. */
  out->cached_free = total.cached_free + pool->draining_bytes + cp_plan_idle_bytes(&pool->plan);
  out->free_blocks = total.free_blocks;
  out->largest_free_block = total.largest_free_block;
  out->pending_free = total.pending_free;
  out->pending_blocks = total.pending_blocks;
  out->fragmentation = out->cached_free ? 1.0 - (double)out->largest_free_block / (double)out->cached_free : 0.0;
}

void cp_oom_fail_locked(cp_pool_t *pool, size_t size, size_t rounded, cp_stream_t stream, cp_oom_info_t *out) {
  cp_oom_capture_locked(pool, size, rounded, stream, out);
  struct timespec ts;
  if (clock_gettime(CLOCK_REALTIME, &ts) == 0) out->time_ns = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
  out->sequence = ++pool->oom_sequence;
  if (pool->evlog.cap != 0) {
    out->log_event = pool->evlog.next;
    cp_evlog_put_locked(pool, CP_TRACE_ALLOC_FAILED, 0, size, stream);
  }
}

void cp_oom_publish(cp_pool_t *pool, cp_oom_info_t *info) {
  size_t dev_free = 0, dev_total = 0;
  if (pool->backend.mem_info(pool->backend.ctx, &dev_free, &dev_total) == CP_OK) {
    info->device_free = dev_free;
    info->device_total = dev_total;
  }
  pthread_mutex_lock(&pool->lock);
  if (info->sequence > pool->last_oom.sequence) pool->last_oom = *info;
  pthread_mutex_unlock(&pool->lock);
}

int cp_pool_last_oom(cp_pool_t *pool, cp_oom_info_t *out) {
  pthread_mutex_lock(&pool->lock);
  *out = pool->last_oom;
  pthread_mutex_unlock(&pool->lock);
  return out->sequence != 0;
}

void cp_pool_oom_now(cp_pool_t *pool, size_t size, cp_stream_t stream, cp_oom_info_t *out) {
  size_t dev_free = 0, dev_total = 0;
  int rc = pool->backend.mem_info(pool->backend.ctx, &dev_free, &dev_total);
  pthread_mutex_lock(&pool->lock);
  cp_oom_capture_locked(pool, size, cp_size_round(&pool->cfg, size), stream, out);
  pthread_mutex_unlock(&pool->lock);
  if (rc == CP_OK) {
    out->device_free = dev_free;
    out->device_total = dev_total;
  }
}

/* ------------------------------------------------------------------------------------------
 * The event log
 * ---------------------------------------------------------------------------------------- */

int cp_pool_set_event_log(cp_pool_t *pool, size_t capacity) {
  if (pool == NULL) return cp_set_error(CP_ERR_INVALID, "cp_pool_set_event_log: NULL pool");
  if (capacity > CP_EVENT_LOG_MAX) {
    return cp_set_error(CP_ERR_INVALID, "cp_pool_set_event_log: %zu events is more than the %zu allowed", capacity,
                        CP_EVENT_LOG_MAX);
  }
  size_t cap = 0;
  cp_trace_event_t *ring = NULL;
  if (capacity != 0) {
    cap = 1;
    while (cap < capacity) cap <<= 1;
    ring = calloc(cap, sizeof *ring);
    if (ring == NULL) {
      return cp_set_error(CP_ERR_HOST_OOM, "cp_pool_set_event_log: no host memory for %zu events", cap);
    }
  }
  pthread_mutex_lock(&pool->lock);
  cp_trace_event_t *old = pool->evlog.ring;
  pool->evlog.ring = ring;
  pool->evlog.cap = cap;
  pool->evlog.mask = cap != 0 ? cap - 1 : 0;
  pool->evlog.start = pool->evlog.next;
  pthread_mutex_unlock(&pool->lock);
  free(old);
  return CP_OK;
}

void cp_evlog_destroy(cp_evlog_t *lg) {
  free(lg->ring);
  memset(lg, 0, sizeof *lg);
}

void cp_event_log_release(cp_event_log_t *log) {
  if (log == NULL) return;
  free(log->events);
  free(log->live);
  memset(log, 0, sizeof *log);
}

int cp_pool_event_log(cp_pool_t *pool, cp_event_log_t *out) {
  if (pool == NULL || out == NULL) return cp_set_error(CP_ERR_INVALID, "cp_pool_event_log: NULL argument");
  memset(out, 0, sizeof *out);
  pthread_mutex_lock(&pool->lock);
  const cp_evlog_t *lg = &pool->evlog;
  uint64_t kept = lg->next - lg->start;
  size_t n = lg->cap == 0 ? 0 : kept < lg->cap ? (size_t)kept : lg->cap;
  size_t n_live = pool->live.count;
  /* The lock stays held: both copies must describe one moment. */
  cp_trace_event_t *events = n != 0 ? malloc(n * sizeof *events) : NULL;
  cp_trace_event_t *live = n_live != 0 ? malloc(n_live * sizeof *live) : NULL;
  if ((n != 0 && events == NULL) || (n_live != 0 && live == NULL)) {
    pthread_mutex_unlock(&pool->lock);
    free(events);
    free(live);
    return cp_set_error(CP_ERR_HOST_OOM, "cp_pool_event_log: no host memory for %zu events and %zu blocks", n, n_live);
  }
  out->first = lg->next - n;
  out->next = lg->next;
  out->capacity = lg->cap;
  for (size_t i = 0; i < n; i++) events[i] = lg->ring[(out->first + i) & lg->mask];
  size_t j = 0;
  for (const cp_segment_t *seg = pool->segments; seg != NULL; seg = seg->next) {
    for (const cp_block_t *b = seg->head; b != NULL; b = b->next) {
      if (b->state != CP_BLOCK_LIVE || j == n_live) continue;
      cp_trace_event_t *e = &live[j++];
      memset(e, 0, sizeof *e);
      e->action = CP_TRACE_ALLOC;
      e->device = pool->backend.device;
      e->id = b->addr;
      e->size = b->requested;
      e->stream = seg->stream->handle;
      e->time_ns = -1;
    }
  }
  pthread_mutex_unlock(&pool->lock);
  out->events = events;
  out->n_events = n;
  out->live = live;
  out->n_live = j;
  return CP_OK;
}
