/* stitch.h — stitched ranges (stitch.c), Note [Stitched ranges]: free pages of page-mapped
 * segments mapped again, side by side, at a new address. */
#ifndef CP_STITCH_H
#define CP_STITCH_H

#include <stdio.h>

#include "core/block.h"

/* Stitched ranges kept for reuse; past that, the least recently used idle one is retired. */
#define CP_STITCH_KEEP 64

/* A large request best fit could not serve: a kept stitched range whose pages are all free,
 * or a new one. CP_OK when served; CP_ERR_OOM when stitching cannot serve it (grow instead);
 * another failure as it came. When it needs a new range while CP_STITCH_KEEP ranges are kept
 * and `past_keep` is false, it stitches nothing and sets *out_full: the caller trims the kept
 * ranges (cp_drain_trim_locked) and asks again with `past_keep`. */
int cp_stitch_alloc_locked(cp_pool_t *pool, cp_stream_state_t *st, size_t rounded, size_t size, bool past_keep,
                           void **out_ptr, bool *out_full);
/* Retire the least recently used idle kept range (not of a stream being captured, unless it is
 * `st`'s): it never serves again, unless taken back before it is unmapped. Returns its stream,
 * whose drain the caller arms, or NULL when there is none. */
cp_stream_state_t *cp_stitch_retire_lru_locked(cp_pool_t *pool, cp_stream_state_t *st);
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

#endif /* CP_STITCH_H */
