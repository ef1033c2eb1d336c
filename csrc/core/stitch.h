/* stitch.h — stitched ranges (stitch.c; stitch_alloc.c makes them); Notes [Stitched ranges], [Handles in part
 * use]: free pages of page-mapped segments mapped again, side by side, at a new address. */
#ifndef CP_STITCH_H
#define CP_STITCH_H

#include <stdio.h>

#include "core/block.h"

/* Note [Stitched ranges]
 * With page_stitching (on top of expandable_segments; expand.c), the pool keeps the handle of
 * every mapping, one per growth (seg->pages; Note [Handles follow growth]), so a handle can
 * be mapped at a second address while it stays mapped in its segment. Scattered free memory
 * is then as good as contiguous memory for a large request:
 *  - One range per stream serves requests of every size: they all count in the large pool
 *    (its stats rows), and the small pool stays empty. Separate pools keep small blocks from
 *    breaking up the memory large requests need; stitching makes that unnecessary, as a large
 *    request can take free pages from anywhere, and one range lets memory freed by one size
 *    serve the other (two pools each peak on their own).
 *  - Ladder: best fit in the stream's index; else a kept stitched range (below); else a new
 *    stitched range from the free whole pages of the stream's segments (the largest free
 *    stretches first: best fit takes them last, so such a range is the likeliest to find its
 *    pages free again when it is next wanted), when they hold enough, or when mapping the missing pages and stitching costs fewer new pages than
 *    growing one segment would; else growth as in expand.c. A request of one page or less
 *    never stitches: a free page would have fitted it.
 *  - A stitched range is an address range of the whole handles that hold the pages the
 *    request needs (the last one may map a little more), with one block (never split) of
 *    exactly those pages: at its start, or past the first run's skip (Note [Handles in part
 *    use]). While that block is in use (LIVE, or PENDING on other streams), the
 *    pages' bytes in their own segments are LENT blocks: out of every index, so nothing else
 *    can be placed on them. When it is freed, the LENT blocks become FREE again (and merge)
 *    and the range is kept, mapped, with its FREE block in no index.
 *  - A kept range serves a later request of the same stream that needs no more pages than it
 *    has, when the pages behind its first bytes (as many as the request needs) are wholly
 *    free in their segments at that moment: its block is then that prefix, and only those
 *    pages are lent; the pages of the rest stay free in their segments, mapped behind unused
 *    addresses. The smallest such range wins, and the oldest among equals. Reuse makes no device call,
 *    and the order of preference is what lets a training loop settle: a step that starts
 *    from the state the previous one started from makes the same choices again, because a
 *    range stitched during that step is younger than every range it could have used (it was
 *    stitched because none of those was free). Up to CP_STITCH_TRIES candidates are looked
 *    at per request.
 *  - Streams: a range is stitched only from pages of its own stream's segments, and its
 *    block serves only that stream, so a page is reused only after the work that used it
 *    (ordered on that stream, or waited for through its PENDING events) is done.
 *  - Memory: a stitched range maps pages that are already counted; reserved bytes do not
 *    change, and address space (stitched_space) grows by the range.
 *  - Bounds: at most CP_STITCH_KEEP ranges are kept; past that, the least recently used idle
 *    one is retired: it never serves again, and is unmapped and its address range given back
 *    (its pages stay in their segments) once the work queued on its stream has finished
 *    (Note [Stream-ordered release], drain.c). empty_cache and the OOM ladder's retry retire
 *    every idle range with the free pages of its stream; the ranges go first, then the pages
 *    (a page is freed only when unmapped everywhere). No range is trimmed during a capture. */

/* Note [Handles in part use]
 * A handle is mapped whole (Note [Handles follow growth], expand.c), so when handles are
 * larger than a page, the free pages of a handle whose other pages are in use could not be
 * stitched: they served only requests that fit the free block holding them, and a request
 * that no free block fitted grew the pool while they lay idle. With handles that follow
 * growth (up to 20 MiB) that left up to a handle's worth of memory idle at every block
 * boundary inside a handle; 2 MiB handles avoid it at up to ten times the cuMemCreate calls.
 * A range is one contiguous address range, so such a handle can still take part at either end:
 *  - first: a handle whose free pages end it (a free block starts inside the handle and runs
 *    to its end) is mapped whole at the range's start, and the range's block starts at its
 *    first free page: the run's `skip` is the part in use, which the range maps but no block
 *    of it covers;
 *  - last: a handle whose free pages start it (a free block ends inside it) is mapped whole at
 *    the range's end, and the block ends within its free pages, as a prefix of the run (the
 *    rest of the run is mapped behind the block's end, as whole handles always could be).
 * Whole free handles are taken first, largest stretches first, as before; only when they fall
 * short are handles in part use added, at most one at each end (the one that completes the
 * request with the fewest pages to spare, else the largest), never the same handle twice. The
 * pages lent are those behind the block only. A kept range with a skip serves again when the
 * pages behind its block are free, its block at the same place. Pages of such a handle that
 * its segment frees while the range is in use are mapped there too: they are neither retired
 * nor released until the block is freed (cp_stitch_alias_from_locked), whichever side of the
 * block they are on. Measured in docs/lab.md ("The frontier"): the worst medium-scale
 * utilization of the lab's workloads rose from 0.980 to 0.994 at the same device time.
 * stitch_partial_handles:False turns it off (whole free handles only). */

/* Stitched ranges kept for reuse; past that, the least recently used idle one is retired. */
#define CP_STITCH_KEEP 64

/* The bytes of run `r` a block of `left` more bytes covers. */
static inline size_t cp_stitch_part(const cp_stitch_run_t *r, size_t left) {
  const size_t room = r->size - r->skip;
  return room < left ? room : left;
}

/* Where a range's block starts: past the first run's skip. */
static inline uintptr_t cp_stitch_block_addr(const cp_segment_t *s) {
  return s->addr + (s->run_count != 0 ? s->runs[0].skip : 0);
}

/* Give the runs of `s` back to their segments' free blocks. */
void cp_stitch_return_locked(cp_pool_t *pool, cp_segment_t *s);
/* Put `s` on the pool's list of stitched ranges (counted in stitched_count and _space). */
void cp_stitch_link_locked(cp_pool_t *pool, cp_segment_t *s);
/* Unmap the first `*mapped` bytes of a stitched range and give back its address range; with
 * the lock dropped. *mapped becomes 0 once the unmap is done, also when giving back the
 * address range fails after it. A range the device refuses to give back is lost to the
 * address space only (its pages are still held by their segments). */
int cp_stitch_unmap_locked(cp_pool_t *pool, uintptr_t addr, size_t size, size_t *mapped);
/* Free the host side of a range on no list, its device side given back. */
void cp_stitch_free_range(cp_pool_t *pool, cp_segment_t *s);
/* Retire the least recently used idle kept range (not of a stream being captured, unless it is
 * `st`'s): it never serves again, unless taken back before it is unmapped. Returns its stream,
 * whose drain the caller arms, or NULL when there is none. */
cp_stream_state_t *cp_stitch_retire_lru_locked(cp_pool_t *pool, cp_stream_state_t *st);
/* The stitched block `b` leaves use (its stats already updated): it is kept, FREE, for reuse,
 * and its pages go back to their segments' free blocks. */
void cp_stitch_release_locked(cp_pool_t *pool, cp_block_t *b);
/* A block that left use (its stats already updated) back to its source: a stitched block to
 * its range, any other merged into its segment's free index. Inline: on every free's path. */
static inline void cp_stitch_give_back_locked(cp_pool_t *pool, cp_block_t *b) {
  if (b->segment->stitched)
    cp_stitch_release_locked(pool, b);
  else
    cp_block_merge_free_locked(pool, b);
}
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
