/* segment.h — plain segments (segment.c): memory reserved from the backend a segment at a
 * time, served by best fit within the size rules, given back whole. */
#ifndef CP_SEGMENT_H
#define CP_SEGMENT_H

#include "core/block.h"
#include "core/sizes.h"

/* All with the pool lock held; the lock is dropped around backend calls. */
/* Reserve one new segment of `seg_size` bytes for (st, kind) and hand out a block of it;
 * `collect` first gives cached segments back as the configuration asks (garbage collection,
 * release_before_grow). */
int cp_segment_grow_locked(cp_pool_t *pool, cp_stream_state_t *st, int kind, size_t rounded, size_t size,
                           size_t seg_size, bool collect, void **out_ptr);
/* Give back every wholly free plain segment; one the backend refuses stays. */
int cp_segment_release_free_locked(cp_pool_t *pool);
/* A new segment of `seg_size` bytes from the backend, within the cap; the lock is dropped
 * around the backend call, with the bytes counted in flight. *out_seg has addr and size set
 * and nothing else: not linked, no blocks. cp_segment_unreserve_locked gives it back (a later
 * step failed); cp_segment_adopt_locked makes it the pool's: serving (st, kind), linked and
 * counted, the high-water mark raised. The caller gives it its blocks. */
int cp_segment_reserve_locked(cp_pool_t *pool, size_t seg_size, cp_segment_t **out_seg);
void cp_segment_unreserve_locked(cp_pool_t *pool, cp_segment_t *seg);
void cp_segment_adopt_locked(cp_pool_t *pool, cp_segment_t *seg, cp_stream_state_t *st, int kind);

/* ------------------------------------------------------------------------------------------
 * Inline, for the path of reuse.
 * ---------------------------------------------------------------------------------------- */

/* Hand the FREE block `b` (not in the index) to the user for a request of `size` rounded
 * bytes (`requested` asked), the rest cut off when the size rules split it. Needs one spare
 * node and live-map room (reserved earlier). */
static inline void *cp_segment_take_locked(cp_pool_t *pool, cp_block_t *b, size_t size, size_t requested) {
  const cp_config_t *cfg = &pool->cfg;
  int kind = b->segment->kind;
  size_t remaining = b->size - size;
  if (remaining > 0 && cp_size_should_split(cfg, kind, size, remaining)) {
    cp_free_insert_locked(pool, cp_block_cut_locked(pool, b, size)); /* b is FREE: so is the rest */
  }
  cp_block_make_live_inline(pool, b, requested);
  return (void *)b->addr;
}

/* Best fit on (stream, kind), within the oversize rules (cp_size_fits), handed out as the LIVE
 * block of a request of `rounded` bytes (`size` asked); NULL when nothing fits. */
static inline cp_block_t *cp_segment_take_fit_locked(cp_pool_t *pool, cp_stream_state_t *st, int kind, size_t rounded,
                                                     size_t size, void **out_ptr) {
  cp_block_t **link;
  cp_block_t *b = cp_index_lower_bound_link(&st->index[kind], rounded, &link);
  if (b == NULL || !cp_size_fits(&pool->cfg, rounded, b->size)) return NULL;
  cp_free_take_at_locked(pool, &st->index[kind], link);
  *out_ptr = cp_segment_take_locked(pool, b, rounded, size);
  return b;
}

#endif /* CP_SEGMENT_H */
