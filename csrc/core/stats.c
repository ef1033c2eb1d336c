/* stats.c — statistics under the built-in allocator's names, and the pool's figures for readers.
 * Owns: the name tables, the resets, and every read-only public query of a pool (stats, info,
 * usage, check, config, base_of); the updates are inline in core/state.h. */
#include <string.h>

#include "core/check.h"
#include "core/index.h"
#include "core/stats.h"

const char *const cp_stat_family_names[CP_STAT_FAMILY_COUNT] = {
#define CP_X(id, name) name,
    CP_STAT_FAMILIES(CP_X)
#undef CP_X
};

static void cp_stat_reset_peak(cp_stat_t *s) { s->peak = s->current; }

static void cp_stat_reset_accumulated(cp_stat_t *s) {
  s->allocated = 0;
  s->freed = 0;
}

void cp_stats_reset_peak(cp_stats_t *st) {
  for (int f = 0; f < CP_STAT_FAMILY_COUNT; f++) {
    for (int k = 0; k < CP_KIND_COUNT; k++) cp_stat_reset_peak(&st->family[f][k]);
  }
  cp_stat_reset_peak(&st->oversize_allocations);
  cp_stat_reset_peak(&st->oversize_segments);
}

void cp_stats_reset_accumulated(cp_stats_t *st) {
  for (int f = 0; f < CP_STAT_FAMILY_COUNT; f++) {
    for (int k = 0; k < CP_KIND_COUNT; k++) cp_stat_reset_accumulated(&st->family[f][k]);
  }
  cp_stat_reset_accumulated(&st->oversize_allocations);
  cp_stat_reset_accumulated(&st->oversize_segments);
#define CP_X(name) st->name = 0;
  CP_STAT_COUNTERS(CP_X)
#undef CP_X
}

/* ------------------------------------------------------------------------------------------
 * Public queries: each takes the pool lock once and changes nothing.
 * ---------------------------------------------------------------------------------------- */

void cp_pool_config(cp_pool_t *pool, cp_config_t *out_cfg) {
  pthread_mutex_lock(&pool->lock);
  *out_cfg = pool->cfg;
  pthread_mutex_unlock(&pool->lock);
}

void cp_pool_stats(cp_pool_t *pool, cp_stats_t *out_stats) {
  pthread_mutex_lock(&pool->lock);
  *out_stats = pool->stats;
  pthread_mutex_unlock(&pool->lock);
}

void cp_pool_reset_peak_stats(cp_pool_t *pool) {
  pthread_mutex_lock(&pool->lock);
  cp_stats_reset_peak(&pool->stats);
  pthread_mutex_unlock(&pool->lock);
}

void cp_pool_reset_accumulated_stats(cp_pool_t *pool) {
  pthread_mutex_lock(&pool->lock);
  cp_stats_reset_accumulated(&pool->stats);
  pthread_mutex_unlock(&pool->lock);
}

static void cp_pool_info_locked(cp_pool_t *pool, cp_pool_info_t *info) {
  memset(info, 0, sizeof *info);
  info->reserved = cp_reserved_locked(pool);
  info->allocated = (size_t)pool->stats.family[CP_STAT_ALLOCATED_BYTES][CP_KIND_ALL].current;
  info->pending_free = pool->streams.pending_bytes;
  info->pending_blocks = pool->streams.pending_blocks;
  info->segments = pool->segment_count;
  info->live_blocks = pool->live.count;
  info->streams = pool->streams.count;
  info->memory_cap = pool->cap_bytes;
  info->page_mapped = pool->paged;
  info->page_segments = pool->paged_segments;
  info->address_space = pool->address_space;
  info->device_map = pool->device_maps;
  info->device_unmap = pool->device_unmaps;
  info->address_space += pool->stitched_space;
  info->stitched_ranges = pool->stitched_count;
  info->stitched_space = pool->stitched_space;
  info->stitches = pool->stitches;
  info->stitch_reuses = pool->stitch_reuses;
  info->paused_bytes = pool->paused_bytes;
  info->backup_bytes = pool->backup_bytes;
  const cp_plan_t *pl = &pool->plan;
  info->plan_state = pl->state;
  info->plan_bytes = pl->bins != NULL ? pl->range_bytes : 0;
  info->plan_step_allocs = pl->count != 0 ? pl->count : pl->last_count;
  info->plan_planned = (size_t)pl->last_planned;
  info->plans = (size_t)pl->plans;
  info->plan_drops = (size_t)pl->drops;
  info->plan_served = (size_t)pl->served;
  info->plan_missed = (size_t)pl->missed;
  info->plan_us = (size_t)(pl->plan_ns / 1000);
  /* Retired memory waiting for its stream (drain.c) is cached too, though not reusable; so is
   * the step plan's memory no planned block uses now. */
  info->cached_free += pool->draining_bytes + cp_plan_idle_bytes(pl);
  for (size_t i = 0; i < pool->streams.count; i++) {
    for (int k = CP_KIND_SMALL; k <= CP_KIND_LARGE; k++) {
      const cp_index_t *ix = &pool->streams.list[i]->index[k];
      info->cached_free += ix->bytes;
      info->free_blocks += ix->count;
      cp_block_t *big = cp_index_largest(ix);
      if (big != NULL && big->size > info->largest_free_block) info->largest_free_block = big->size;
    }
  }
}

/* stats.h */
void cp_pool_info_no_device(cp_pool_t *pool, cp_pool_info_t *out_info) {
  pthread_mutex_lock(&pool->lock);
  cp_pool_info_locked(pool, out_info);
  pthread_mutex_unlock(&pool->lock);
}

void cp_pool_info(cp_pool_t *pool, cp_pool_info_t *out_info) {
  size_t dev_free = 0, dev_total = 0;
  int rc = pool->backend.mem_info(pool->backend.ctx, &dev_free, &dev_total);
  pthread_mutex_lock(&pool->lock);
  cp_pool_info_locked(pool, out_info);
  pthread_mutex_unlock(&pool->lock);
  if (rc == CP_OK) {
    out_info->device_free = dev_free;
    out_info->device_total = dev_total;
  }
}

void cp_pool_usage(cp_pool_t *pool, size_t *out_allocated, size_t *out_reserved) {
  pthread_mutex_lock(&pool->lock);
  *out_allocated = (size_t)pool->stats.family[CP_STAT_ALLOCATED_BYTES][CP_KIND_ALL].current;
  *out_reserved = cp_reserved_locked(pool);
  pthread_mutex_unlock(&pool->lock);
}

size_t cp_pool_check(cp_pool_t *pool, FILE *out) {
  pthread_mutex_lock(&pool->lock);
  size_t v = cp_check_locked(pool, out);
  pthread_mutex_unlock(&pool->lock);
  return v;
}

int cp_pool_base_of(cp_pool_t *pool, const void *ptr, void **out_base, size_t *out_size) {
  if (pool == NULL || ptr == NULL) return CP_PTR_FOREIGN;
  const uintptr_t p = (uintptr_t)ptr;
  int kind = CP_PTR_FOREIGN;
  pthread_mutex_lock(&pool->lock);
  const cp_segment_t *seg = NULL;
  const cp_block_t *b = cp_ptrmap_get(&pool->live, p);
  if (b != NULL) {
    kind = CP_PTR_LIVE;
    seg = b->segment;
  } else {
    /* Unsigned: an address below the segment wraps to a large offset. */
    for (seg = pool->segments; seg != NULL && p - seg->addr >= seg->size; seg = seg->next) {}
    if (seg == NULL) { /* or inside a stitched range */
      for (seg = pool->stitched; seg != NULL && p - seg->addr >= seg->size; seg = seg->next) {}
    }
    if (seg != NULL) {
      kind = CP_PTR_HELD;
      for (b = seg->head; b != NULL && p - b->addr >= b->size; b = b->next) {}
      if (b != NULL && b->state == CP_BLOCK_LIVE) kind = CP_PTR_LIVE;
    }
  }
  if (seg != NULL) {
    /* Page-mapped memory is no one driver allocation: its range is mostly address space with
     * nothing behind it. The block itself is the span known to be mapped and its caller's. */
    const bool mapped_piece = (seg->paged || seg->stitched) && b != NULL;
    if (out_base != NULL) *out_base = (void *)(mapped_piece ? b->addr : seg->addr);
    if (out_size != NULL) *out_size = mapped_piece ? b->size : seg->size;
  }
  pthread_mutex_unlock(&pool->lock);
  return kind;
}
