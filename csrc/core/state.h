/* state.h — the pool's state (one struct guarded by one lock) and the inline counter updates.
 * Owns no functions: each part of the struct names the file that keeps it. */
#ifndef CP_STATE_H
#define CP_STATE_H

#include <pthread.h>

#include "base/fork.h"
#include "base/ptrmap.h"
#include "core/plan_types.h"
#include "core/snapshot.h"
#include "core/stream.h"

/* ------------------------------------------------------------------------------------------
 * Statistics (read in stats.c). Inline updates: every alloc and free touch several families.
 * ---------------------------------------------------------------------------------------- */

static inline void cp_stat_inc(cp_stat_t *s, int64_t amount) {
  s->current += amount;
  s->allocated += amount;
  if (s->current > s->peak) s->peak = s->current;
}

static inline void cp_stat_dec(cp_stat_t *s, int64_t amount) {
  s->current -= amount;
  s->freed += amount;
}

static inline void cp_stat_add(cp_stat_t *s, int64_t delta) {
  if (delta >= 0)
    cp_stat_inc(s, delta);
  else
    cp_stat_dec(s, -delta);
}

/* Update the family's `all` row and the row of `kind`. */
static inline void cp_stats_inc(cp_stats_t *st, cp_stat_family_t fam, int kind, size_t amount) {
  cp_stat_inc(&st->family[fam][CP_KIND_ALL], (int64_t)amount);
  cp_stat_inc(&st->family[fam][kind], (int64_t)amount);
}

static inline void cp_stats_dec(cp_stats_t *st, cp_stat_family_t fam, int kind, size_t amount) {
  cp_stat_dec(&st->family[fam][CP_KIND_ALL], (int64_t)amount);
  cp_stat_dec(&st->family[fam][kind], (int64_t)amount);
}

static inline void cp_stats_update(cp_stats_t *st, cp_stat_family_t fam, int kind, int64_t delta) {
  cp_stat_add(&st->family[fam][CP_KIND_ALL], delta);
  cp_stat_add(&st->family[fam][kind], delta);
}

/* ------------------------------------------------------------------------------------------
 * The pool
 * ---------------------------------------------------------------------------------------- */

#define CP_BLOCK_SLAB 256

/* The event log's ring (oom.c): events [next - n, next) sit at ring[seq & mask], where
 * n = min(next - start, mask + 1) and `start` is the number of the first event since the
 * ring was (re)made. cap == 0: no log; then ring == NULL. */
typedef struct cp_evlog_s {
  cp_trace_event_t *ring;
  size_t mask;    /* cap - 1 */
  size_t cap;     /* a power of two, or 0 */
  uint64_t next;  /* the number the next event gets */
  uint64_t start; /* the number of the ring's first event */
} cp_evlog_t;

typedef struct cp_block_slab_s {
  struct cp_block_slab_s *next;
  cp_block_t blocks[CP_BLOCK_SLAB];
} cp_block_slab_t;

/* ------------------------------------------------------------------------------------------
 * Graph capture (capture.c), Note [Capture in the pool]
 *
 * `windows` counts the capture windows open on the pool (cp_pool_capture_begin minus
 * cp_pool_capture_end). A free that would record events while a capture is under way is
 * deferred: the block stays LIVE (in the live map, counted as allocated) and is listed in
 * `deferred`, each at most once; cp_capture_flush_locked frees them once no capture is under
 * way. Every listed block is LIVE and has use_count > 0.
 * ---------------------------------------------------------------------------------------- */

typedef struct cp_capture_s {
  unsigned windows;
  cp_block_t **deferred; /* frees waiting for the end of the capture */
  size_t deferred_count;
  size_t deferred_cap;
} cp_capture_t;

struct cp_pool_s {
  pthread_mutex_t lock;     /* guards everything below; never held across a blocking call */
  cp_fork_lock_t fork_node; /* `lock` is held across fork() (Note [Locks across fork]) */
  cp_config_t cfg;
  cp_backend_t backend;
  cp_stats_t stats;

  cp_ptrmap_t live;     /* addr -> LIVE block */
  cp_streams_t streams; /* per-stream state, events and the PENDING lifecycle (stream.c) */

  cp_segment_t *segments; /* every segment held, most recent first */
  size_t segment_count;
  uint64_t segment_serials;         /* segments numbered so far (cp_segment_t.serial) */
  cp_segment_t *free_segments_head; /* wholly free segments, in the order they became so */
  cp_segment_t *free_segments_tail;
  size_t free_segment_count;

  cp_block_t *spare_blocks; /* unused block nodes, linked through `left` */
  cp_block_slab_t *slabs;

  size_t inflight_bytes; /* reserves under way without the lock (counted against the cap) */
  size_t high_water;     /* the most ever reserved (+ in flight then); never reset */
  size_t cap_bytes;      /* effective cap, 0 = none */
  size_t device_total;   /* from the backend at creation, 0 when unknown */

  /* Page-mapped segments (expand.c). */
  bool paged;              /* expandable_segments and the device has page-mapped memory */
  size_t vmm_granularity;  /* the device's, when paged */
  size_t paged_segments;   /* page-mapped segments held */
  size_t address_space;    /* their bytes of address space */
  size_t device_maps;      /* page_map calls made */
  size_t device_unmaps;    /* page_unmap calls made */
  size_t draining_streams; /* streams with `draining` set (drain.c) */
  size_t draining_bytes;   /* bytes of DRAINING blocks */
  size_t retired_ranges;   /* stitched ranges with `retired` set */

  /* Stitched ranges (stitch.c), Note [Stitched ranges]. */
  bool stitch;                  /* paged and page_stitching */
  cp_segment_t *stitched;       /* every stitched range, linked through prev/next */
  size_t stitched_count;        /* ranges on that list */
  size_t stitched_space;        /* their bytes of address space */
  size_t stitches;              /* ranges stitched so far */
  size_t stitch_reuses;         /* requests served by a kept range */
  uint64_t stitch_clock;        /* ticks at every free of a stitched block */
  struct cp_history_s *history; /* NULL unless history is recorded (history.c) */
  uint64_t history_seq;         /* records made over the pool's life */
  /* The segment observer (cp_pool_set_segment_observer): NULL unless one is set. */
  cp_segment_observer_t segment_observer;
  void *segment_observer_ctx;
  /* Out of memory and the event log (oom.c). */
  cp_evlog_t evlog;
  cp_oom_info_t last_oom; /* sequence 0: no failure yet */
  uint64_t oom_sequence;  /* failures so far (never reset) */
  cp_capture_t capture;   /* graph capture (capture.c) */
  size_t stitch_inflight; /* bytes lent to ranges being stitched without the lock */
  /* Paused regions (pause.c): sum of the states' paused_bytes and backup_bytes. */
  size_t paused_bytes;
  size_t backup_bytes;
  cp_plan_t plan; /* the step plan (plan.c), Note [Learning the step] */
};

/* Bytes held from the backend (the reserved_bytes stat). */
static inline size_t cp_reserved_locked(const cp_pool_t *pool) {
  return (size_t)pool->stats.family[CP_STAT_RESERVED_BYTES][CP_KIND_ALL].current;
}

#endif /* CP_STATE_H */
