/* replay.c — replays an allocation trace through a pool, fast enough for millions of events.
 * Owns: the id -> pointer map of a replay and the figures measured on the way. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/seed.h"
#include "core/stats.h"

_Static_assert(sizeof(cp_trace_event_t) == 40, "cp_trace_event_t must match the 40-byte trace record");

/* A non-NULL marker for ids whose allocation was skipped (size 0 or another device). */
static char cp_replay_skip_marker;

struct cp_replay_s {
  cp_pool_t *pool;
  int device;       /* -1: every device */
  cp_ptrmap_t live; /* trace id -> pointer, or -> &cp_replay_skip_marker */
  cp_replay_result_t res;
  cp_stats_t stats0;    /* the pool's stats when the replay began */
  size_t win_allocated; /* maxima since the last cp_replay_window */
  size_t win_reserved;
  cp_replay_use_fn use; /* the work that last used a block, queued at its free (or NULL) */
  void *use_arg;
};

void cp_replay_set_use(cp_replay_t *r, cp_replay_use_fn use, void *arg) {
  r->use = use;
  r->use_arg = arg;
}

static uint64_t cp_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

int cp_replay_create(cp_pool_t *pool, int device, cp_replay_t **out_replay) {
  if (pool == NULL || out_replay == NULL) return cp_set_error(CP_ERR_INVALID, "cp_replay_create: NULL argument");
  cp_replay_t *r = calloc(1, sizeof *r);
  if (r == NULL) return cp_set_error(CP_ERR_HOST_OOM, "cp_replay_create: no host memory");
  int rc = cp_ptrmap_init(&r->live, 4096);
  if (rc != CP_OK) {
    free(r);
    return rc;
  }
  r->pool = pool;
  r->device = device;
  cp_pool_stats(pool, &r->stats0);
  *out_replay = r;
  return CP_OK;
}

/* After an allocation: the usage maxima, and the free memory's shape at a new peak. */
static void cp_replay_observe(cp_replay_t *r) {
  size_t allocated, reserved;
  cp_pool_usage(r->pool, &allocated, &reserved);
  if (allocated > r->win_allocated) r->win_allocated = allocated;
  if (reserved > r->win_reserved) r->win_reserved = reserved;
  if (reserved > r->res.peak_reserved) {
    cp_pool_info_t info;
    cp_pool_info_no_device(r->pool, &info); /* no device call: the replay counts those */
    r->res.peak_reserved = reserved;
    r->res.cached_free_at_peak = info.cached_free;
    r->res.largest_free_at_peak = info.largest_free_block;
  }
}

int cp_replay_feed(cp_replay_t *r, const cp_trace_event_t *events, size_t n) {
  if (r->res.oom) return CP_ERR_OOM;
  uint64_t t0 = cp_now_ns();
  int rc = CP_OK;
  for (size_t i = 0; i < n; i++) {
    const cp_trace_event_t *e = &events[i];
    uint64_t index = r->res.events++;
    bool ours = r->device < 0 || e->device == r->device;
    if (e->action == CP_TRACE_RELEASE) {
      if (ours) {
        r->res.releases++;
        (void)cp_empty_cache(r->pool); /* what the device refuses back stays cached */
      }
      continue;
    }
    if (e->action == CP_TRACE_ALLOC) {
      if (cp_ptrmap_get(&r->live, e->id) != NULL) {
        r->res.bad_events++; /* the id is live already */
        continue;
      }
      void *p = &cp_replay_skip_marker;
      if (!ours || e->size == 0) {
        r->res.skipped++;
      } else {
        rc = cp_alloc(r->pool, (size_t)e->size, (cp_stream_t)e->stream, &p);
        if (rc != CP_OK) {
          r->res.oom = rc == CP_ERR_OOM;
          r->res.oom_event = index;
          r->res.oom_size = e->size;
          break;
        }
        r->res.allocs++;
      }
      rc = cp_ptrmap_insert(&r->live, e->id, p);
      if (rc != CP_OK) {
        if (p != &cp_replay_skip_marker) cp_free(r->pool, p);
        break;
      }
      if (p != &cp_replay_skip_marker) cp_replay_observe(r);
    } else {
      void *p = cp_ptrmap_remove(&r->live, e->id);
      if (p == NULL) {
        r->res.bad_events++; /* freed without an alloc in the trace (it began mid-run) */
      } else if (p == &cp_replay_skip_marker) {
        r->res.skipped++;
      } else {
        /* The traced program used the block on its stream until it freed it. */
        size_t size = 0;
        if (r->use != NULL && cp_pool_lookup(r->pool, p, &size)) r->use(r->use_arg, (uintptr_t)p, size, e->stream);
        cp_free(r->pool, p);
        r->res.frees++;
      }
    }
  }
  r->res.ns += cp_now_ns() - t0;
  return rc;
}

int cp_replay_seed_segment(cp_replay_t *r, cp_stream_t stream, int kind, size_t segment_size,
                           const cp_seed_block_t *blocks, size_t n) {
  if (r == NULL || (n > 0 && blocks == NULL))
    return cp_set_error(CP_ERR_INVALID, "cp_replay_seed_segment: NULL argument");
  /* Ids: distinct, and not live in the replay (checked before anything changes). */
  cp_ptrmap_t seen;
  int rc = cp_ptrmap_init(&seen, 2 * n + 16);
  for (size_t i = 0; rc == CP_OK && i < n; i++) {
    const uint64_t id = blocks[i].id;
    if (cp_ptrmap_get(&r->live, id) != NULL || cp_ptrmap_get(&seen, id) != NULL) {
      rc = cp_set_error(CP_ERR_INVALID, "seed segment: block %zu (id %#llx, offset %zu): the id is live already", i,
                        (unsigned long long)id, blocks[i].offset);
    } else {
      rc = cp_ptrmap_insert(&seen, id, &cp_replay_skip_marker);
    }
  }
  cp_ptrmap_destroy(&seen);
  if (rc == CP_OK) rc = cp_ptrmap_reserve(&r->live, n);
  uintptr_t addr = 0;
  if (rc == CP_OK) rc = cp_seed_segment(r->pool, stream, kind, segment_size, blocks, n, &addr);
  if (rc != CP_OK) return rc;
  for (size_t i = 0; i < n; i++) cp_ptrmap_insert(&r->live, blocks[i].id, (void *)(addr + blocks[i].offset));
  cp_replay_observe(r);
  return CP_OK;
}

void cp_replay_result(const cp_replay_t *r, cp_replay_result_t *out) {
  *out = r->res;
  cp_stats_t now;
  cp_pool_stats(r->pool, &now);
  out->peak_allocated = (size_t)now.family[CP_STAT_ALLOCATED_BYTES][CP_KIND_ALL].peak;
  out->peak_requested = (size_t)now.family[CP_STAT_REQUESTED_BYTES][CP_KIND_ALL].peak;
  out->device_allocs = (uint64_t)(now.num_device_alloc - r->stats0.num_device_alloc);
  out->device_frees = (uint64_t)(now.num_device_free - r->stats0.num_device_free);
}

void cp_replay_window(cp_replay_t *r, size_t *out_max_allocated, size_t *out_max_reserved) {
  size_t allocated, reserved;
  cp_pool_usage(r->pool, &allocated, &reserved);
  *out_max_allocated = r->win_allocated > allocated ? r->win_allocated : allocated;
  *out_max_reserved = r->win_reserved > reserved ? r->win_reserved : reserved;
  r->win_allocated = allocated;
  r->win_reserved = reserved;
}

void cp_replay_destroy(cp_replay_t *r) {
  if (r == NULL) return;
  for (size_t i = 0; i <= r->live.mask; i++) {
    void *p = r->live.slots[i].value;
    if (p != NULL && p != &cp_replay_skip_marker) cp_free(r->pool, p);
  }
  cp_ptrmap_destroy(&r->live);
  free(r);
}
