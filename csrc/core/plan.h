/* plan.h — the step plan in service (plan.c), Note [Learning the step] in plan_types.h. */
#ifndef CP_PLAN_H
#define CP_PLAN_H

#include "core/state.h"

/* All with the pool lock held. */
/* At creation: learning starts when plan_steps is set and the pool stitches pages. */
void cp_plan_init(cp_pool_t *pool);
/* At destroy: the plan's host memory (its bins went with the pool's segments). */
void cp_plan_destroy(cp_pool_t *pool);
/* cp_plan_alloc_locked's answers besides CP_OK: the pool serves the allocation itself; or the
 * plan's adoption needs an overflow range of pl->overflow_bytes from the pool's ladder, handed
 * (NULL when the ladder could not) to cp_plan_adopt_finish_locked, whose answer counts. */
#define CP_PLAN_PASS     1
#define CP_PLAN_OVERFLOW 2
/* An allocation of `rounded` bytes (`size` asked) on `stream`, untagged, outside capture
 * windows: CP_OK with *out_ptr when the plan serves it; else, when *out_watch is not 0 once
 * the pool served it, cp_plan_watch_block_locked is told which block it gave. */
int cp_plan_alloc_locked(cp_pool_t *pool, size_t rounded, size_t size, cp_stream_t stream, void **out_ptr,
                         uint64_t *out_watch);
int cp_plan_adopt_finish_locked(cp_pool_t *pool, cp_block_t *overflow, size_t size, void **out_ptr);
void cp_plan_watch_block_locked(cp_pool_t *pool, void *ptr, uint64_t watch);
/* A planned node's use ended (its free, or its last stream event): its place is free. */
void cp_plan_release_locked(cp_pool_t *pool, cp_block_t *node);
/* Give the plan up (the out-of-memory ladder, empty_cache): its bins go back to the pool now
 * when none of its blocks is in use (true), else when the last one is freed (false). */
bool cp_plan_give_up_locked(cp_pool_t *pool);

#endif /* CP_PLAN_H */
