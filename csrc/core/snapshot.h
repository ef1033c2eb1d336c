/* snapshot.h — the public API of snapshots and history (history.c): what the pool holds now
 * and what it did lately, in the terms of torch's memory snapshots. Apart from cp.h, which it
 * builds on, so that cp.h stays the pool's own API. */
#ifndef CP_SNAPSHOT_H
#define CP_SNAPSHOT_H

#include <stddef.h>
#include <stdint.h>

#include "core/cp.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------------------------
 * Snapshots and history (history.c): what the pool holds now, and what it did lately, in
 * the terms of torch's memory snapshots (Note [History]).
 * ---------------------------------------------------------------------------------------- */

/* A block's state in a snapshot; the values are the core's block states. */
enum {
  CP_SNAP_FREE = 0,      /* cached, reusable */
  CP_SNAP_LIVE = 1,      /* allocated */
  CP_SNAP_PENDING = 2,   /* freed, waiting for the streams it was used on */
  CP_SNAP_UNMAPPED = 3,  /* page-mapped segment: no memory behind it */
  CP_SNAP_MAPPING = 4,   /* page-mapped segment: being mapped now (not yet memory) */
  CP_SNAP_UNMAPPING = 5, /* page-mapped segment: being unmapped now (still memory) */
  CP_SNAP_LENT = 6,      /* page-mapped segment: memory a stitched range's block in use holds */
  CP_SNAP_DRAINING = 7   /* page-mapped segment: free memory retired, unmapped once its stream's
                          * queued work is done (still memory) */
};

typedef struct cp_snapshot_block_s {
  uintptr_t addr;
  size_t size;
  size_t requested; /* bytes asked for (LIVE and PENDING), else 0 */
  int state;        /* CP_SNAP_* */
} cp_snapshot_block_t;

typedef struct cp_snapshot_segment_s {
  uintptr_t addr;
  size_t size;   /* bytes reserved; the address range when page-mapped */
  size_t mapped; /* page-mapped: bytes mapped; else == size */
  cp_stream_t stream;
  int kind;           /* CP_KIND_SMALL or CP_KIND_LARGE */
  int page_mapped;    /* 1 for a page-mapped segment */
  uint32_t tag;       /* its region (0: none) */
  size_t paused;      /* bytes of it given back by a pause (its blocks keep their states) */
  size_t first_block; /* its blocks: blocks[first_block .. first_block + block_count), by address */
  size_t block_count;
} cp_snapshot_segment_t;

typedef struct cp_snapshot_s {
  cp_snapshot_segment_t *segments; /* by address */
  size_t segment_count;
  cp_snapshot_block_t *blocks;
  size_t block_count;
} cp_snapshot_t;

/* Copy every segment and block of the pool (one walk under the lock; no device call).
 * CP_ERR_HOST_OOM when the arrays cannot be had (then *out is empty). cp_snapshot_free gives
 * the arrays back (and empties *out); it accepts an empty snapshot. */
int cp_pool_snapshot(cp_pool_t *pool, cp_snapshot_t *out);
void cp_snapshot_free(cp_snapshot_t *snap);

/* Note [Torch's segments]
 * torch's snapshot knows three block states and shows an expandable segment as one segment per
 * stretch of memory behind it. So a segment is cut into runs, each one of torch's segments: the
 * blocks with no memory behind them (UNMAPPED, MAPPING) are left out and end a run. The bridge
 * (torch's SnapshotInfo) and the binding (Pool.snapshot()'s "runs") both cut here. */
enum { CP_TORCH_NO_MEMORY = -1, CP_TORCH_INACTIVE, CP_TORCH_ALLOCATED, CP_TORCH_PENDING };
/* torch's state of a block in CP_SNAP_* state `state`: ALLOCATED (live, lent), PENDING, INACTIVE. */
int cp_snapshot_torch_state(int state);
typedef struct cp_snapshot_run_s {
  size_t first_block, block_count; /* snap->blocks[first_block .. first_block + block_count) */
  uintptr_t addr;                  /* its first block's */
  size_t total_size;               /* sums over its blocks: all, ALLOCATED ones, active ones */
  size_t allocated_size, active_size, requested_size;
} cp_snapshot_run_t;
/* The next run of `seg` (of `snap`) from its block *pos on (0: the first): 1, *out and *pos
 * past it; 0 when none is left. */
int cp_snapshot_next_run(const cp_snapshot_t *snap, const cp_snapshot_segment_t *seg, size_t *pos,
                         cp_snapshot_run_t *out);

/* History actions, named as torch's trace entries name them. */
#define CP_HISTORY_ACTIONS(X)         \
  X(ALLOC, "alloc")                   \
  X(FREE_REQUESTED, "free_requested") \
  X(FREE_COMPLETED, "free_completed") \
  X(SEGMENT_ALLOC, "segment_alloc")   \
  X(SEGMENT_FREE, "segment_free")     \
  X(SEGMENT_MAP, "segment_map")       \
  X(SEGMENT_UNMAP, "segment_unmap")   \
  X(OOM, "oom")                       \
  X(ANNOTATE, "annotate")

typedef enum cp_history_action_e {
#define CP_X(id, name) CP_HIST_##id,
  CP_HISTORY_ACTIONS(CP_X)
#undef CP_X
      CP_HIST_ACTION_COUNT
} cp_history_action_t;

extern const char *const cp_history_action_names[CP_HIST_ACTION_COUNT];

/* One record of the history: 56 bytes, fixed size. */
typedef struct cp_history_entry_s {
  uint64_t seq;     /* 1, 2, ...: the order of recording over the pool's life */
  int64_t time_ns;  /* wall clock (CLOCK_REALTIME), nanoseconds since the epoch */
  uint64_t addr;    /* the block or range; 0 for OOM */
  uint64_t size;    /* its bytes (the block's, rounded); OOM: the bytes asked for */
  uint64_t stream;  /* the allocation stream of the block or segment; OOM: the request's */
  uint64_t context; /* the recording thread's context (cp_history_set_context) for ALLOC,
                     * FREE_REQUESTED, OOM and ANNOTATE; 0 for the others and when none was set */
  uint32_t action;  /* cp_history_action_t */
  uint32_t tag;     /* the recording thread's tag (cp_history_set_tag) for every action; ANNOTATE:
                     * the annotation's; 0 when none was set */
} cp_history_entry_t;

/* Keep the last `max_entries` records (0: stop recording and drop them). Changing the size
 * drops what was recorded; the sequence numbers go on. CP_ERR_HOST_OOM when the buffer cannot
 * be had: then the history is off. */
int cp_pool_history_enable(cp_pool_t *pool, size_t max_entries);
/* Copy the records held, oldest first, into out[0..cap): when more are held than fit, the
 * newest `cap`. Returns how many were copied; *out_recorded (unless NULL) receives how many
 * were ever recorded (so recorded - held were overwritten), *out_capacity (unless NULL) the
 * ring's size (0 when off). */
size_t cp_pool_history_read(cp_pool_t *pool, cp_history_entry_t *out, size_t cap, uint64_t *out_recorded,
                            size_t *out_capacity);
/* Note [Segment observer]
 * A function told of every change of the device memory behind the pool, as it happens:
 * CP_HIST_SEGMENT_ALLOC / SEGMENT_FREE for a plain segment reserved or given back,
 * CP_HIST_SEGMENT_MAP / SEGMENT_UNMAP for a range of a page-mapped segment mapped or unmapped
 * (also by pause and resume). It is called with the pool lock held, once the change is made
 * (memory given back is gone by then), whether history is recorded or not: it must
 * not call into the pool, and should be quick (torch's trace trackers: NCCL registers and
 * deregisters memory there). NULL removes it. */
typedef void (*cp_segment_observer_t)(void *ctx, int action, uintptr_t addr, size_t size, cp_stream_t stream);
int cp_pool_set_segment_observer(cp_pool_t *pool, cp_segment_observer_t fn, void *ctx);

/* The calling thread's context id, stored in the records it makes from now on (0: none).
 * The caller sets it before an operation and clears it after; the core never interprets it. */
void cp_history_set_context(uint64_t context);
/* The calling thread's tag, stored in every record it makes from now on, whatever the action
 * (0: none): a binding's label for what the thread is doing (torch's user metadata). It stays
 * set until the thread sets another; the core never interprets it. */
void cp_history_set_tag(uint32_t tag);
/* Record an ANNOTATE for the live allocation at `ptr` (its base address): its address, size and
 * stream, `tag` as the record's tag and the thread's context. CP_ERR_INVALID (nothing recorded)
 * when `ptr` is not the base of a live allocation of the pool; CP_OK, recording nothing, when
 * history is off. */
int cp_pool_history_annotate(cp_pool_t *pool, const void *ptr, uint32_t tag);

#ifdef __cplusplus
}
#endif

#endif /* CP_SNAPSHOT_H */
