/* expand.h — page-mapped segments (expand.c), Note [Expandable segments]: address ranges
 * reserved once and mapped in handles as they grow. */
#ifndef CP_EXPAND_H
#define CP_EXPAND_H

#include "core/block.h"

/* At creation: decide whether the pool is paged (expandable_segments and VMM entries). */
void cp_expand_init(cp_pool_t *pool);
/* Best fit among the mapped FREE blocks of (st, kind), handed out as the LIVE block of a
 * request of `rounded` bytes. CP_OK, or CP_ERR_OOM when none holds it. */
int cp_expand_take_fit_locked(cp_pool_t *pool, cp_stream_state_t *st, int kind, size_t rounded, size_t size,
                              void **out_ptr);
/* try_allocate_expandable_block: grow a segment of (st, kind), a new one when none can, until
 * a FREE block holds `rounded` bytes, and hand it out. */
/* CP_ERR_STATE, with the error set, when the region of `st` is paused (Note [Paused regions] in
 * pause.c): nothing may be taken or mapped for it then. CP_OK otherwise. An allocation asks
 * again after every step that lets go of the lock: a pause may have begun meanwhile. */
int cp_expand_paused_error(const cp_stream_state_t *st);
static inline int cp_expand_refuse_paused(const cp_stream_state_t *st) {
  return CP_UNLIKELY(st->paused) ? cp_expand_paused_error(st) : CP_OK;
}
int cp_expand_grow_locked(cp_pool_t *pool, cp_stream_state_t *st, int kind, size_t rounded, size_t size,
                          void **out_ptr);
/* Retire [lo, hi) (whole handles) of the FREE block `b` of a page-mapped segment: that part
 * leaves the index as a DRAINING block, counted in the pool's and the stream's draining bytes,
 * the rest stays FREE. Returns the DRAINING block, or NULL (no metadata: nothing changed). */
cp_block_t *cp_expand_retire_range_locked(cp_pool_t *pool, cp_block_t *b, uintptr_t lo, uintptr_t hi);
/* Give back the address range of every wholly unmapped page-mapped segment (nothing is mapped
 * there, so no queued work can touch it). */
int cp_expand_drop_unmapped_locked(cp_pool_t *pool);
/* The DRAINING blocks of `seg` back to FREE (merged, indexed). */
void cp_expand_revive_locked(cp_pool_t *pool, cp_segment_t *seg);
/* Unmap the DRAINING blocks of `seg` (their stream's work is done): UNMAPPING without the
 * lock, then UNMAPPED; a range the device refuses comes back FREE. A segment left wholly
 * unmapped gives back its address range (*out_dropped = true: `seg` is gone). */
int cp_expand_unmap_draining_locked(cp_pool_t *pool, cp_segment_t *seg, bool *out_dropped);
/* Room in seg->pages for the granules below `slots` (kept handles); CP_ERR_HOST_OOM. */
int cp_expand_page_slots_locked(cp_segment_t *seg, size_t slots);
/* Whether [addr, addr + size) of `seg` is a stretch a pause unmapped (pause.c). */
bool cp_expand_paused_span(const cp_segment_t *seg, uintptr_t addr, size_t size);
/* At destroy: unmap everything still mapped (not what a pause unmapped) and give back the
 * address space (no lock needed). */
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

#endif /* CP_EXPAND_H */
