/* stitch_alloc.h — a large request served by stitching (stitch_alloc.c; Note [Stitched ranges]
 * in stitch.h). */
#ifndef CP_STITCH_ALLOC_H
#define CP_STITCH_ALLOC_H

#include "core/stitch.h"

/* A large request best fit could not serve: a kept stitched range whose pages are all free,
 * or a new one. CP_OK when served; CP_ERR_OOM when stitching cannot serve it (grow instead);
 * another failure as it came. When it needs a new range while CP_STITCH_KEEP ranges are kept
 * and `past_keep` is false, it stitches nothing and sets *out_full: the caller trims the kept
 * ranges (cp_drain_trim_locked) and asks again with `past_keep`. */
int cp_stitch_alloc_locked(cp_pool_t *pool, cp_stream_state_t *st, size_t rounded, size_t size, bool past_keep,
                           void **out_ptr, bool *out_full);

#endif /* CP_STITCH_ALLOC_H */
