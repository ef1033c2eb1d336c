/* block.h — the block layer (block.c): blocks, segments, split and merge, the free index of
 * each (stream, kind) and the list of wholly free segments. It knows no policy: which block
 * serves a request, when to grow and what to give back are decided above it. */
#ifndef CP_BLOCK_H
#define CP_BLOCK_H

#include "core/index.h"
#include "core/state.h"

/* All with the pool lock held. */
/* Make sure `n` spare block nodes and room for one more live block exist, so that the rest
 * of an operation cannot fail half-way. */
int cp_reserve_metadata_locked(cp_pool_t *pool, int n);
cp_block_t *cp_block_new_locked(cp_pool_t *pool); /* a spare node, zeroed */
void cp_block_delete_locked(cp_pool_t *pool, cp_block_t *b);
/* Give `seg` (addr and size set) its one block, covering it, in `state`; a spare node. */
cp_block_t *cp_segment_head_locked(cp_pool_t *pool, cp_segment_t *seg, cp_block_state_t state);
/* Put the FREE block `b` into its index (and the free-segment list when it is unsplit). */
void cp_free_insert_locked(cp_pool_t *pool, cp_block_t *b);
/* Remove the FREE block `b` from its index (and the free-segment list). */
void cp_free_remove_locked(cp_pool_t *pool, cp_block_t *b);
/* Make `b` LIVE with `requested` bytes: live map (room reserved), allocation stats. */
void cp_block_make_live_locked(cp_pool_t *pool, cp_block_t *b, size_t requested);
/* Return a FREE block already out of the index (merges with FREE neighbours, indexes). */
void cp_block_merge_free_locked(cp_pool_t *pool, cp_block_t *b);
/* The pool's list of segments (plain and page-mapped); a plain one counts as reserved while
 * linked. */
void cp_segment_link_locked(cp_pool_t *pool, cp_segment_t *seg);
void cp_segment_unlink_locked(cp_pool_t *pool, cp_segment_t *seg);
/* Take wholly free segments out of the pool (oldest first) until `want_bytes` are gathered
 * (0 = all). They are chained through `next` into *out_list; stats already exclude them. */
size_t cp_free_segments_detach_locked(cp_pool_t *pool, size_t want_bytes, cp_segment_t **out_list);
/* Reserved bytes plus those being reserved without the lock: what growth counts. */
size_t cp_held_locked(const cp_pool_t *pool);
/* Take `seg` off the list of wholly free segments (cp_free_removed_locked's slow side). */
void cp_free_segment_unlink_locked(cp_pool_t *pool, cp_segment_t *seg);

/* ------------------------------------------------------------------------------------------
 * Inline, for the path of reuse: taking a block out of the index, making it LIVE, and back.
 * ---------------------------------------------------------------------------------------- */

/* The accounting of a FREE block that just left its index: inactive_split when it is part of
 * its segment, else its segment leaves the list of wholly free segments. */
static inline void cp_free_removed_locked(cp_pool_t *pool, cp_block_t *b) {
  if (cp_block_is_split(b)) {
    cp_stats_dec(&pool->stats, CP_STAT_INACTIVE_SPLIT, b->segment->kind, 1);
    cp_stats_dec(&pool->stats, CP_STAT_INACTIVE_SPLIT_BYTES, b->segment->kind, b->size);
  } else {
    cp_free_segment_unlink_locked(pool, b->segment);
  }
}

/* Take the FREE block at `link` (from cp_index_lower_bound_link on `ix`) out of the index. */
static inline cp_block_t *cp_free_take_at_locked(cp_pool_t *pool, cp_index_t *ix, cp_block_t **link) {
  cp_block_t *b = *link;
  cp_index_remove_at(ix, link);
  cp_free_removed_locked(pool, b);
  return b;
}

/* cp_block_make_live_locked, inline. */
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

/* A LIVE or PENDING block leaves use: the active stats drop and it holds no request. */
static inline void cp_block_end_use_locked(cp_pool_t *pool, cp_block_t *b) {
  int kind = b->segment->kind;
  cp_stats_dec(&pool->stats, CP_STAT_ACTIVE, kind, 1);
  cp_stats_dec(&pool->stats, CP_STAT_ACTIVE_BYTES, kind, b->size);
  cp_stats_dec(&pool->stats, CP_STAT_REQUESTED_BYTES, kind, b->requested);
  b->requested = 0;
  b->use_count = 0;
  b->shared = 0;
}

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

#endif /* CP_BLOCK_H */
