/* seed.c — seeding a pool with a segment laid out as a recorded run had it: the state at the
 * first event of a trace that begins mid-run (a torch snapshot's window).
 * Owns: the validation of a seed layout and the building of its segment. */
#include <stdlib.h>

#include "core/check.h"
#include "core/seed.h"
#include "core/segment.h"

/* CP_OK when the layout fits the rules of cp_replay_seed_segment (ids aside); else
 * CP_ERR_INVALID naming the first bad block. */
static int cp_seed_check(const cp_config_t *cfg, int kind, size_t segment_size, const cp_seed_block_t *blocks,
                         size_t n) {
  const size_t g = cfg->granule;
  if (kind != CP_KIND_SMALL && kind != CP_KIND_LARGE) {
    return cp_set_error(CP_ERR_INVALID, "seed segment: kind %d is neither small (%d) nor large (%d)", kind,
                        CP_KIND_SMALL, CP_KIND_LARGE);
  }
  if (segment_size == 0 || segment_size % g != 0) {
    return cp_set_error(CP_ERR_INVALID, "seed segment: size %zu is not a positive multiple of the granule (%zu)",
                        segment_size, g);
  }
  if (n > 0 && blocks == NULL) return cp_set_error(CP_ERR_INVALID, "seed segment: NULL blocks");
  size_t end = 0; /* the end of the previous block */
  for (size_t i = 0; i < n; i++) {
    const cp_seed_block_t *b = &blocks[i];
    const char *why = NULL;
    if (b->size == 0 || b->size % g != 0 || b->offset % g != 0) {
      why = "offset and size must be multiples of the granule, size positive";
    } else if (b->requested == 0 || b->requested > b->size) {
      why = "requested must be 1..size";
    } else if (b->offset < end) {
      why = "overlaps the previous block or comes before it (blocks must be sorted by offset)";
    } else if (b->offset > segment_size || b->size > segment_size - b->offset) {
      why = "ends past the segment";
    }
    if (why != NULL) {
      return cp_set_error(CP_ERR_INVALID,
                          "seed segment of %zu bytes: block %zu (id %#llx, offset %zu, size %zu, requested %zu): %s",
                          segment_size, i, (unsigned long long)b->id, b->offset, b->size, b->requested, why);
    }
    end = b->offset + b->size;
  }
  return CP_OK;
}

/* Append a block of [addr, addr + size) to `seg` after `prev` (NULL: as the head). */
static cp_block_t *cp_seed_append_locked(cp_pool_t *pool, cp_segment_t *seg, cp_block_t *prev, uintptr_t addr,
                                         size_t size) {
  cp_block_t *b = cp_block_new_locked(pool);
  b->addr = addr;
  b->size = size;
  b->segment = seg;
  b->prev = prev;
  if (prev != NULL)
    prev->next = b;
  else
    seg->head = b;
  return b;
}

int cp_seed_segment(cp_pool_t *pool, cp_stream_t stream, int kind, size_t segment_size, const cp_seed_block_t *blocks,
                    size_t n, uintptr_t *out_addr) {
  int rc = cp_seed_check(&pool->cfg, kind, segment_size, blocks, n);
  if (rc != CP_OK) return rc;
  if (n > (size_t)(INT32_MAX / 2 - 1)) return cp_set_error(CP_ERR_INVALID, "seed segment: %zu blocks is too many", n);
  const int nodes = (int)(2 * n + 1); /* every block, and a gap before each and after the last */

  pthread_mutex_lock(&pool->lock);
  cp_segment_t *seg = NULL;
  rc = cp_segment_reserve_locked(pool, segment_size, &seg);
  cp_stream_state_t *st = NULL;
  /* Spare nodes for every block, and live-map room for the live ones: one slab per call. */
  for (int have = 0; rc == CP_OK && have < nodes;) {
    rc = cp_reserve_metadata_locked(pool, nodes);
    have = 0;
    for (cp_block_t *b = pool->spare_blocks; b != NULL && have < nodes; b = b->left) have++;
  }
  if (rc == CP_OK) rc = cp_ptrmap_reserve(&pool->live, n);
  if (rc == CP_OK) {
    st = cp_streams_get_locked(&pool->streams, stream);
    if (st == NULL) rc = cp_set_error(CP_ERR_HOST_OOM, "seed segment: no host memory for a stream");
  }
  if (rc != CP_OK) {
    if (seg != NULL) cp_segment_unreserve_locked(pool, seg);
    pthread_mutex_unlock(&pool->lock);
    return rc;
  }

  const uintptr_t addr = seg->addr;
  cp_segment_adopt_locked(pool, seg, st, kind);
  cp_block_t *prev = NULL;
  size_t at = 0;
  for (size_t i = 0; i <= n; i++) {
    const size_t next = i < n ? blocks[i].offset : segment_size;
    if (next > at) prev = cp_seed_append_locked(pool, seg, prev, addr + at, next - at); /* a gap: FREE */
    if (i == n) break;
    prev = cp_seed_append_locked(pool, seg, prev, addr + next, blocks[i].size);
    cp_block_make_live_locked(pool, prev, blocks[i].requested);
    at = next + blocks[i].size;
  }
  /* The FREE blocks go into the index once the segment is whole: split-ness is final then. */
  for (cp_block_t *b = seg->head; b != NULL; b = b->next) {
    if (b->state == CP_BLOCK_FREE) cp_free_insert_locked(pool, b);
  }
  CP_DEBUG_CHECK(pool, "cp_replay_seed_segment");
  pthread_mutex_unlock(&pool->lock);
  *out_addr = addr;
  return CP_OK;
}
