/* seed.h — segments laid out as a snapshot recorded them (seed.c), for replays. */
#ifndef CP_SEED_H
#define CP_SEED_H

#include "core/state.h"

/* Seeding (seed.c): reserve one segment of exactly `segment_size` bytes for (stream, kind)
 * and lay out `blocks` LIVE in it at their offsets, the gaps FREE; the blocks' ids are not
 * looked at. Validated first (cp_seed_check): on any error nothing changes. *out_addr
 * receives the segment's address (block i is at *out_addr + blocks[i].offset). */
int cp_seed_segment(cp_pool_t *pool, cp_stream_t stream, int kind, size_t segment_size, const cp_seed_block_t *blocks,
                    size_t n, uintptr_t *out_addr);

#endif /* CP_SEED_H */
