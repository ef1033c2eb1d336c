/* cp_internal.h — the core's internal types and cross-file functions, grouped by owning file.
 * Nothing here is API: bindings and tests use cp.h (tests of one module may include this). */
#ifndef CP_INTERNAL_H
#define CP_INTERNAL_H

#include <pthread.h>
#include <stdbool.h>

#include "base/fork.h"
#include "base/ptrmap.h"
#include "core/cp.h"

typedef struct cp_block_s cp_block_t;
typedef struct cp_segment_s cp_segment_t;
typedef struct cp_stream_state_s cp_stream_state_t;

/* ------------------------------------------------------------------------------------------
 * Blocks and segments (pool.c)
 *
 * A segment is one backend reservation. Its blocks tile it exactly, in address order:
 *   seg->head->addr == seg->addr,  b->next->addr == b->addr + b->size,
 *   sum(b->size for b in seg) == seg->size,  no two neighbouring blocks are both FREE.
 * A block is in exactly one state:
 *   FREE     in the index of (seg->stream, seg->kind), not in the live map;
 *   LIVE     handed to a user, in the live map, not in the index;
 *   PENDING  freed by the user, waiting for `pending_events` stream events; in neither.
 * Blocks of different segments never merge, even when their addresses touch.
 *
 * A page-mapped segment (seg->paged, expand.c) is an address range of which only some whole
 * chunks are mapped; its blocks tile the whole range, and three more states cover what is not
 * (or not yet, or no longer) memory. None of them is ever in an index or the live map:
 *   UNMAPPED   no memory behind it (whole chunks); never next to another UNMAPPED block;
 *   MAPPING    unmapped chunks being mapped right now, without the lock;
 *   UNMAPPING  mapped chunks being unmapped right now, without the lock.
 * With page_stitching (stitch.c) a fourth state lends mapped bytes to a stitched range:
 *   LENT       whole pages whose memory a stitched block in use holds (at another address).
 * Memory given back waits for its stream first (drain.c, Note [Stream-ordered release]):
 *   DRAINING   whole free chunks retired for unmapping, waiting for the work queued on the
 *              segment's stream before the retirement (the stream's drain event); still
 *              mapped and reserved, in no index, never handed out until revived (FREE).
 * FREE merges only with FREE, so mapped and unmapped blocks never merge. For each such
 *   seg->mapped == sum of the sizes of its FREE, LIVE, PENDING, LENT and DRAINING blocks (UNMAPPING
 *   bytes are out of it, and out of reserved_bytes, from the moment they are carved out),
 * and at least one block is UNMAPPED or MAPPING (the last chunk is never mapped), so a FREE
 * block of a page-mapped segment is always split and such a segment is never on the list of
 * wholly free segments. reserved_bytes == sum(seg->size of plain) + sum(seg->mapped of paged).
 * ---------------------------------------------------------------------------------------- */

typedef enum cp_block_state_e {
  CP_BLOCK_FREE = 0,
  CP_BLOCK_LIVE = 1,
  CP_BLOCK_PENDING = 2,
  CP_BLOCK_UNMAPPED = 3,
  CP_BLOCK_MAPPING = 4,
  CP_BLOCK_UNMAPPING = 5,
  CP_BLOCK_LENT = 6,
  CP_BLOCK_DRAINING = 7
} cp_block_state_t;

struct cp_block_s {
  uintptr_t addr;
  size_t size;      /* bytes, a multiple of the granule */
  size_t requested; /* bytes the user asked for; 0 when FREE */
  cp_segment_t *segment;
  cp_block_t *prev;        /* lower neighbour in the segment, NULL for the head */
  cp_block_t *next;        /* higher neighbour, NULL for the tail */
  cp_block_t *left;        /* index (treap) children, FREE only; `left` doubles as the */
  cp_block_t *right;       /*   spare-list link when the node is unused */
  uint32_t priority;       /* treap heap key, derived from the address */
  uint8_t state;           /* cp_block_state_t */
  uint32_t pending_events; /* PENDING: events still to complete */
  uint32_t use_count;      /* streams other than the allocation stream (record_stream) */
  uint32_t use_cap;
  cp_stream_t *uses; /* heap array of those streams, NULL when none ever recorded */
};

struct cp_segment_s {
  uintptr_t addr;
  size_t size;               /* bytes reserved from the backend (address space when paged) */
  size_t mapped;             /* paged: bytes mapped (what reserved_bytes counts); else 0 */
  size_t chunk;              /* paged: bytes mapped and unmapped at a time; else 0 */
  bool paged;                /* a page-mapped segment (expand.c) */
  cp_stream_state_t *stream; /* allocation stream: its blocks serve only this stream */
  uint8_t kind;              /* CP_KIND_SMALL or CP_KIND_LARGE */
  cp_block_t *head;          /* lowest-address block */
  cp_segment_t *prev;        /* pool's segment list */
  cp_segment_t *next;
  cp_segment_t *free_prev; /* the pool's list of wholly free segments, while this one is */
  cp_segment_t *free_next;
  bool in_free_list;
  bool drop_failed; /* scratch of cp_expand_drop_unmapped_locked */
  /* paged with page_stitching: the page mapped at each granule of the range (0: none), for
   * the first `page_slots` granules; the pool keeps these handles until it unmaps them. */
  cp_page_t *pages;
  size_t page_slots;
  /* A stitched range (stitch.c): on the pool's list of those, never on `segments`. */
  bool stitched;
  struct cp_stitch_run_s *runs; /* where its pages come from, in the range's order */
  size_t run_count;
  uint64_t last_use;   /* the pool's stitch clock when its block was last freed */
  uint64_t born;       /* the pool's stitch count when it was stitched (its age) */
  bool broken;         /* never serves: kept only until it is unmapped and given back */
  bool retired;        /* broken by a release: waits for its stream's drain event (drain.c) */
  bool trim_only;      /* retired by the trim of kept ranges alone: it may still serve its stream */
  bool release_failed; /* scratch of cp_stitch_drop_retired_locked */
};

/* One run of a stitched range: `size` bytes of the page-mapped segment `seg` at `addr`,
 * mapped next in the stitched range; `lent` is the LENT block holding them while the stitched
 * block is in use (LIVE or PENDING), else NULL. */
typedef struct cp_stitch_run_s {
  cp_segment_t *seg;
  uintptr_t addr;
  size_t size;
  cp_block_t *lent;
} cp_stitch_run_t;

static inline bool cp_block_is_split(const cp_block_t *b) { return b->prev != NULL || b->next != NULL; }
static inline bool cp_segment_is_free(const cp_segment_t *s) {
  return s->head->state == CP_BLOCK_FREE && s->head->next == NULL;
}

/* ------------------------------------------------------------------------------------------
 * Free-block index (index.c): a treap of FREE blocks ordered by (size, addr), one per
 * (stream, kind). Priorities come from the address, so shapes are deterministic.
 * Expected O(log n) insert, remove and lower-bound.
 * ---------------------------------------------------------------------------------------- */

typedef struct cp_index_s {
  cp_block_t *root;
  size_t count; /* nodes in the tree */
  size_t bytes; /* sum of their sizes */
} cp_index_t;

void cp_index_insert(cp_index_t *ix, cp_block_t *b);
void cp_index_remove(cp_index_t *ix, cp_block_t *b);
/* The smallest block with size >= `size` (lowest address among equals), or NULL. When
 * `out_link` is not NULL it receives the link that points at the block, for
 * cp_index_remove_at (valid until the tree next changes). */
cp_block_t *cp_index_lower_bound(const cp_index_t *ix, size_t size);
cp_block_t *cp_index_lower_bound_link(cp_index_t *ix, size_t size, cp_block_t ***out_link);
void cp_index_remove_at(cp_index_t *ix, cp_block_t **link);
cp_block_t *cp_index_largest(const cp_index_t *ix);
/* The node right after `b` in (size, addr) order, or NULL. */
cp_block_t *cp_index_next(const cp_index_t *ix, const cp_block_t *b);
bool cp_index_contains(const cp_index_t *ix, const cp_block_t *b);
/* Count tree-shape violations (order, heap, count, bytes); describe them on `out`. */
size_t cp_index_check(const cp_index_t *ix, FILE *out);
/* Call fn on every node, in order. */
void cp_index_each(const cp_index_t *ix, void (*fn)(cp_block_t *b, void *arg), void *arg);

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
};

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

/* ------------------------------------------------------------------------------------------
 * Statistics (stats.c). Inline updates: every alloc and free touch several families.
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

void cp_stats_reset_peak(cp_stats_t *st);
void cp_stats_reset_accumulated(cp_stats_t *st);

/* ------------------------------------------------------------------------------------------
 * The pool (pool.c)
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
  /* Out of memory and the event log (oom.c). */
  cp_evlog_t evlog;
  cp_oom_info_t last_oom; /* sequence 0: no failure yet */
  uint64_t oom_sequence;  /* failures so far (never reset) */
  cp_capture_t capture;   /* graph capture (capture.c) */
  size_t stitch_inflight; /* bytes lent to ranges being stitched without the lock */
};

/* Graph capture (capture.c). cp_capturing_locked: whether an event call or a release now
 * could break a capture: a window is open, or the backend says `stream` is being captured. */
bool cp_capturing_locked(cp_pool_t *pool, cp_stream_t stream);
/* Whether freeing the LIVE block `b` (use_count > 0) must wait for the end of the capture. */
bool cp_capture_must_defer_locked(cp_pool_t *pool, const cp_block_t *b);
/* List `b` for freeing after the capture (CP_ERR_HOST_OOM, nothing changed); a block listed
 * already stays listed once (CP_ERR_INVALID: a second free of the same pointer). */
int cp_capture_defer_locked(cp_pool_t *pool, cp_block_t *b);
/* Free the listed blocks (recording their events) when no capture is under way. */
void cp_capture_flush_locked(cp_pool_t *pool);
void cp_capture_destroy(cp_pool_t *pool);
/* The free of cp_free_impl once the block is known (pool.c): record events or give it back. */
int cp_free_block_locked(cp_pool_t *pool, cp_block_t *b, const char *who);

/* pool.c internals the seeding of replays (seed.c) builds segments with; lock held. */
/* Make sure `n` spare block nodes and room for one more live block exist. */
int cp_reserve_metadata_locked(cp_pool_t *pool, int n);
cp_block_t *cp_block_new_locked(cp_pool_t *pool); /* a spare node, zeroed */
/* Give `seg` (addr and size set) its one block, covering it, in `state`; a spare node. */
cp_block_t *cp_segment_head_locked(cp_pool_t *pool, cp_segment_t *seg, cp_block_state_t state);
/* Put the FREE block `b` into its index (and the free-segment list when it is unsplit). */
void cp_free_insert_locked(cp_pool_t *pool, cp_block_t *b);
/* A new segment of `seg_size` bytes from the backend, within the cap; the lock is dropped
 * around the backend call, with the bytes counted in flight. *out_seg has addr and size set
 * and nothing else: not linked, no blocks. cp_segment_unreserve_locked gives it back (a later
 * step failed); cp_segment_adopt_locked makes it the pool's: serving (st, kind), linked and
 * counted, the high-water mark raised. The caller gives it its blocks. */
int cp_segment_reserve_locked(cp_pool_t *pool, size_t seg_size, cp_segment_t **out_seg);
void cp_segment_unreserve_locked(cp_pool_t *pool, cp_segment_t *seg);
void cp_segment_adopt_locked(cp_pool_t *pool, cp_segment_t *seg, cp_stream_state_t *st, int kind);
/* Make `b` LIVE with `requested` bytes: live map (room reserved), allocation stats. */
void cp_block_make_live_locked(cp_pool_t *pool, cp_block_t *b, size_t requested);
/* Reserved bytes plus those being reserved without the lock. */
size_t cp_held_locked(const cp_pool_t *pool);

/* Seeding (seed.c): reserve one segment of exactly `segment_size` bytes for (stream, kind)
 * and lay out `blocks` LIVE in it at their offsets, the gaps FREE; the blocks' ids are not
 * looked at. Validated first (cp_seed_check): on any error nothing changes. *out_addr
 * receives the segment's address (block i is at *out_addr + blocks[i].offset). */
int cp_seed_segment(cp_pool_t *pool, cp_stream_t stream, int kind, size_t segment_size, const cp_seed_block_t *blocks,
                    size_t n, uintptr_t *out_addr);

/* More of pool.c for expand.c; lock held. */
/* Return a FREE block already out of the index (merges with FREE neighbours, indexes). */
void cp_block_merge_free_locked(cp_pool_t *pool, cp_block_t *b);
void cp_block_delete_locked(cp_pool_t *pool, cp_block_t *b);
/* Remove the FREE block `b` from its index (and the free-segment list). */
void cp_free_remove_locked(cp_pool_t *pool, cp_block_t *b);
void cp_segment_link_locked(cp_pool_t *pool, cp_segment_t *seg);
void cp_segment_unlink_locked(cp_pool_t *pool, cp_segment_t *seg);
/* Reuse what completed frees give back (non-blocking); a failed query is returned (what it
 * left pending is polled again next time). */
int cp_reclaim_completed_locked(cp_pool_t *pool);
int cp_synchronize_pending_locked(cp_pool_t *pool);
/* Give back every wholly free plain segment. */
int cp_release_free_segments_locked(cp_pool_t *pool);

/* ------------------------------------------------------------------------------------------
 * Page-mapped segments (expand.c), Note [Expandable segments]
 * ---------------------------------------------------------------------------------------- */

/* At creation: decide whether the pool is paged (expandable_segments and VMM entries). */
void cp_expand_init(cp_pool_t *pool);
/* cp_alloc of a paged pool, lock held: the whole ladder. */
int cp_expand_alloc_locked(cp_pool_t *pool, cp_stream_state_t *st, int kind, size_t rounded, size_t size,
                           void **out_ptr);
/* Retire the whole free chunks of `seg` (page-mapped): FREE -> DRAINING, pages a stitched
 * range in use still maps left out. Returns the bytes retired. Lock held, no device call. */
size_t cp_expand_retire_locked(cp_pool_t *pool, cp_segment_t *seg);
/* Give back the address range of every wholly unmapped page-mapped segment (nothing is mapped
 * there, so no queued work can touch it). */
int cp_expand_drop_unmapped_locked(cp_pool_t *pool);
/* The DRAINING blocks of `seg` back to FREE (merged, indexed). */
void cp_expand_revive_locked(cp_pool_t *pool, cp_segment_t *seg);
/* Unmap the DRAINING blocks of `seg` (their stream's work is done): UNMAPPING without the
 * lock, then UNMAPPED; a range the device refuses comes back FREE. A segment left wholly
 * unmapped gives back its address range (*out_dropped = true: `seg` is gone). */
int cp_expand_unmap_draining_locked(cp_pool_t *pool, cp_segment_t *seg, bool *out_dropped);
/* At destroy: unmap everything and give back the address space (no lock needed). */
void cp_expand_destroy_segment(cp_pool_t *pool, cp_segment_t *seg);
/* The bytes of one mapping step of a paged segment of `kind`. */
size_t cp_expand_chunk(const cp_pool_t *pool, int kind);
/* find_expandable_block: the block to grow from for `size` bytes, or NULL. */
cp_block_t *cp_expand_find_locked(cp_pool_t *pool, cp_stream_state_t *st, int kind, size_t size);
/* Map the first `bytes` (whole chunks) of the UNMAPPED block `u` (see expand.c). */
int cp_expand_map_locked(cp_pool_t *pool, cp_block_t *u, size_t bytes, cp_block_t **out_free);
/* Handle edges of a page-mapped segment (Note [Handles follow growth], expand.c): whether
 * `addr` starts a handle, and the nearest edge at or above / at or below `addr`. */
bool cp_expand_handle_edge(const cp_segment_t *seg, uintptr_t addr);
uintptr_t cp_expand_edge_up(const cp_segment_t *seg, uintptr_t addr);
uintptr_t cp_expand_edge_down(const cp_segment_t *seg, uintptr_t addr);

/* ------------------------------------------------------------------------------------------
 * Stream-ordered release (drain.c), Note [Stream-ordered release]
 * ---------------------------------------------------------------------------------------- */

/* Retire what every stream not being captured can give back (free whole chunks, idle
 * stitched ranges) and record each such stream's drain event. No waiting. */
int cp_drain_retire_all_locked(cp_pool_t *pool);
/* Arm the drain of `st` after something of it was retired: (re)record its drain event. On
 * failure what `st` retired comes back into service. */
int cp_drain_arm_locked(cp_pool_t *pool, cp_stream_state_t *st);
/* Unmap what the streams retired once their drain events are done: `wait` waits for them
 * (event_synchronize, those streams only, lock dropped); else only done ones are reaped. */
int cp_drain_reap_all_locked(cp_pool_t *pool, bool wait);
/* For `st` alone, while DRAINING memory of it waits: reap when its event is done, else put
 * that memory back into service (an allocation of the stream needs it more than the device
 * does). Returns whether memory came back. */
bool cp_drain_reclaim_stream_locked(cp_pool_t *pool, cp_stream_state_t *st);
/* At destroy: every drain event back to the spares (the memory is unmapped by destroy). */
void cp_drain_destroy(cp_pool_t *pool);

/* ------------------------------------------------------------------------------------------
 * Stitched ranges (stitch.c), Note [Stitched ranges]
 * ---------------------------------------------------------------------------------------- */

/* A large request best fit could not serve: a kept stitched range whose pages are all free,
 * or a new one. CP_OK when served; CP_ERR_OOM when stitching cannot serve it (grow instead);
 * another failure as it came. */
int cp_stitch_alloc_locked(cp_pool_t *pool, cp_stream_state_t *st, size_t rounded, size_t size, void **out_ptr);
/* The stitched block `b` leaves use (its stats already updated): it is kept, FREE, for reuse,
 * and its pages go back to their segments' free blocks. */
void cp_stitch_release_locked(cp_pool_t *pool, cp_block_t *b);
/* Retire every idle range of `st` (retired and broken: it never serves again and waits for
 * the stream's drain event); returns how many. No device call. */
size_t cp_stitch_retire_idle_locked(cp_pool_t *pool, cp_stream_state_t *st);
/* Retired ranges of `st` back in service (those still wholly mapped). */
void cp_stitch_revive_locked(cp_pool_t *pool, cp_stream_state_t *st);
/* Unmap and give back every retired, or broken, idle range of `st` (its drain event is done).
 * *out_left: some range of `st` not in use still maps pages (the device refused to drop it):
 * its segments must not unmap them. */
int cp_stitch_drop_retired_locked(cp_pool_t *pool, cp_stream_state_t *st, bool *out_left);
/* The first address of [lo, hi) in `seg` whose page a stitched range in use also maps past the
 * end of its block (a kept range serving a smaller request), or hi: unmapped in `seg`, such a
 * page would stay on the device through that mapping. */
uintptr_t cp_stitch_alias_from_locked(const cp_pool_t *pool, const cp_segment_t *seg, uintptr_t lo, uintptr_t hi);
/* At destroy: unmap and give back every stitched range (no lock needed). */
void cp_stitch_destroy(cp_pool_t *pool);
/* The checker's part: count violations, tallying the live and pending stitched blocks. */
size_t cp_stitch_check_locked(cp_pool_t *pool, FILE *out, size_t *live, size_t *live_bytes, size_t *active,
                              size_t *active_bytes, size_t *requested, size_t *lent_bytes);

/* Cut `b` at `offset` bytes: b keeps the lower part, the returned node (a spare the caller
 * reserved) the upper one, in b's state. Index membership is the caller's. */
static inline cp_block_t *cp_block_cut_locked(cp_pool_t *pool, cp_block_t *b, size_t offset) {
  cp_block_t *r = cp_block_new_locked(pool);
  r->addr = b->addr + offset;
  r->size = b->size - offset;
  r->segment = b->segment;
  r->state = b->state;
  r->prev = b;
  r->next = b->next;
  if (b->next != NULL) b->next->prev = r;
  b->next = r;
  b->size = offset;
  return r;
}

/* The inverse of a cut: `b` takes over its upper neighbour's bytes, and the neighbour, now out
 * of the segment's list, is returned for the caller to delete. Index membership is the
 * caller's. */
static inline cp_block_t *cp_block_absorb_next(cp_block_t *b) {
  cp_block_t *n = b->next;
  b->size += n->size;
  b->next = n->next;
  if (n->next != NULL) n->next->prev = b;
  return n;
}

/* Bytes held from the backend (the reserved_bytes stat). */
static inline size_t cp_reserved_locked(const cp_pool_t *pool) {
  return (size_t)pool->stats.family[CP_STAT_RESERVED_BYTES][CP_KIND_ALL].current;
}

/* ------------------------------------------------------------------------------------------
 * Out of memory and the event log (oom.c)
 * ---------------------------------------------------------------------------------------- */

/* Append one event to the log (nothing when it is off: one branch). */
static inline void cp_evlog_put_locked(cp_pool_t *pool, uint8_t action, uintptr_t id, size_t size, cp_stream_t stream) {
  cp_evlog_t *lg = &pool->evlog;
  if (lg->cap == 0) return;
  cp_trace_event_t *e = &lg->ring[lg->next & lg->mask];
  e->action = action;
  e->device = pool->backend.device;
  e->id = id;
  e->size = size;
  e->stream = stream;
  e->time_ns = -1;
  lg->next++;
}

/* A failed allocation, lock held: fill *out with the pool's figures (not the device's),
 * count it in the pool's sequence, log it and keep nothing yet (cp_oom_publish keeps it). */
void cp_oom_fail_locked(cp_pool_t *pool, size_t size, size_t rounded, cp_stream_t stream, cp_oom_info_t *out);
/* Without the lock: ask the device for its free and total memory into *info, then make it
 * the pool's latest record (unless a later failure got there first). */
void cp_oom_publish(cp_pool_t *pool, cp_oom_info_t *info);
/* At destroy. */
void cp_evlog_destroy(cp_evlog_t *lg);

/* cp_pool_info without asking the device (no mem_info call): device_free and device_total
 * stay 0. For the replay, whose own measuring must not add to the device calls it counts. */
void cp_pool_info_no_device(cp_pool_t *pool, cp_pool_info_t *out_info);

/* ------------------------------------------------------------------------------------------
 * History (history.c), Note [History]: a ring of cp_history_entry_t, recorded under the pool
 * lock. Invariants: count <= capacity; count == min(records made since the ring was made, capacity);
 * the oldest record is at (head - count) mod capacity, the newest at head - 1.
 * ---------------------------------------------------------------------------------------- */

typedef struct cp_history_s {
  cp_history_entry_t *ring;
  size_t capacity; /* > 0 */
  size_t head;     /* where the next record goes */
  size_t count;    /* records held */
} cp_history_t;

#if defined(__GNUC__)
#define CP_UNLIKELY(x) __builtin_expect(!!(x), 0)
#define CP_COLD        __attribute__((cold, noinline))
#else
#define CP_UNLIKELY(x) (x)
#define CP_COLD
#endif

/* Record one event when history is on: one predictable branch when it is off. Lock held. */
#define CP_HISTORY(pool, action, addr, size, stream)                                                                \
  do {                                                                                                              \
    if (CP_UNLIKELY((pool)->history != NULL)) cp_history_record_locked((pool), (action), (addr), (size), (stream)); \
  } while (0)

CP_COLD void cp_history_record_locked(cp_pool_t *pool, int action, uintptr_t addr, size_t size, cp_stream_t stream);
/* The end of cp_alloc: ALLOC of the block at `ptr` when rc is CP_OK, OOM of `size` bytes when
 * it is CP_ERR_OOM, nothing otherwise. */
CP_COLD void cp_history_alloc_locked(cp_pool_t *pool, int rc, const void *ptr, size_t size, cp_stream_t stream);
/* A free: FREE_REQUESTED, and FREE_COMPLETED too when the block is reusable at once. */
CP_COLD void cp_history_free_locked(cp_pool_t *pool, const cp_block_t *b);
/* At destroy. */
void cp_history_destroy(cp_pool_t *pool);

/* The checker (check.c). */
size_t cp_check_locked(cp_pool_t *pool, FILE *out);

#ifdef CP_CHECK_EVERY_OP
void cp_check_or_abort_locked(cp_pool_t *pool, const char *where);
#define CP_DEBUG_CHECK(pool, where) cp_check_or_abort_locked((pool), (where))
#else
#define CP_DEBUG_CHECK(pool, where) ((void)0)
#endif

#endif /* CP_INTERNAL_H */
