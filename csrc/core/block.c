/* block.c — the block layer: block nodes, segments' block lists, split and merge, the free
 * index of each (stream, kind) and the list of wholly free segments. Owns: block nodes and
 * the segment list. It decides nothing: the memory sources above say which block to take,
 * where to cut it and when a segment goes (segment.c, expand.c, stitch.c). */
#include <stdlib.h>
#include <string.h>

#include "core/block.h"

/* ------------------------------------------------------------------------------------------
 * Block nodes
 * ---------------------------------------------------------------------------------------- */

int cp_reserve_metadata_locked(cp_pool_t *pool, int n) {
  if (n == 1 && pool->spare_blocks != NULL && (pool->live.count + 1) * 2 <= pool->live.mask + 1) {
    return CP_OK; /* the common case, without walking or calling out */
  }
  int have = 0;
  for (cp_block_t *b = pool->spare_blocks; b != NULL && have < n; b = b->left) have++;
  if (have < n) {
    cp_block_slab_t *slab = calloc(1, sizeof *slab);
    if (slab == NULL) return cp_set_error(CP_ERR_HOST_OOM, "cudapool: no host memory for block metadata");
    slab->next = pool->slabs;
    pool->slabs = slab;
    for (int i = CP_BLOCK_SLAB - 1; i >= 0; i--) {
      slab->blocks[i].left = pool->spare_blocks;
      pool->spare_blocks = &slab->blocks[i];
    }
  }
  return cp_ptrmap_reserve(&pool->live, 1);
}

cp_block_t *cp_block_new_locked(cp_pool_t *pool) {
  cp_block_t *b = pool->spare_blocks; /* guaranteed by cp_reserve_metadata_locked */
  pool->spare_blocks = b->left;
  memset(b, 0, sizeof *b);
  return b;
}

cp_block_t *cp_segment_head_locked(cp_pool_t *pool, cp_segment_t *seg, cp_block_state_t state) {
  cp_block_t *head = cp_block_new_locked(pool);
  head->addr = seg->addr;
  head->size = seg->size;
  head->segment = seg;
  head->state = (uint8_t)state;
  seg->head = head;
  return head;
}

void cp_block_delete_locked(cp_pool_t *pool, cp_block_t *b) {
  if (b->uses != NULL) {
    free(b->uses);
    b->uses = NULL;
  }
  b->left = pool->spare_blocks;
  pool->spare_blocks = b;
}

/* ------------------------------------------------------------------------------------------
 * The free index and the list of wholly free segments
 * ---------------------------------------------------------------------------------------- */

/* Index insert/remove that keep the inactive_split stats: a FREE block counts there when it
 * is only part of its segment. A block's split-ness changes only while it is out of the
 * index, so counting at these two points is exact (cp_free_insert_locked here,
 * cp_free_removed_locked in block.h). */
/* The list of wholly free segments: a segment is on it exactly while its one block is FREE
 * and in the index, so giving back cached memory never walks the segments in use. */
static void cp_free_segment_push_locked(cp_pool_t *pool, cp_segment_t *seg) {
  seg->free_next = NULL;
  seg->free_prev = pool->free_segments_tail;
  if (pool->free_segments_tail != NULL)
    pool->free_segments_tail->free_next = seg;
  else
    pool->free_segments_head = seg;
  pool->free_segments_tail = seg;
  seg->in_free_list = true;
  pool->free_segment_count++;
}

void cp_free_segment_unlink_locked(cp_pool_t *pool, cp_segment_t *seg) {
  if (seg->free_prev != NULL)
    seg->free_prev->free_next = seg->free_next;
  else
    pool->free_segments_head = seg->free_next;
  if (seg->free_next != NULL)
    seg->free_next->free_prev = seg->free_prev;
  else
    pool->free_segments_tail = seg->free_prev;
  seg->free_prev = seg->free_next = NULL;
  seg->in_free_list = false;
  pool->free_segment_count--;
}

void cp_free_insert_locked(cp_pool_t *pool, cp_block_t *b) {
  cp_segment_t *seg = b->segment;
  cp_index_insert(&seg->stream->index[seg->kind], b);
  if (cp_block_is_split(b)) {
    cp_stats_inc(&pool->stats, CP_STAT_INACTIVE_SPLIT, seg->kind, 1);
    cp_stats_inc(&pool->stats, CP_STAT_INACTIVE_SPLIT_BYTES, seg->kind, b->size);
  } else {
    cp_free_segment_push_locked(pool, seg);
  }
}

void cp_free_remove_locked(cp_pool_t *pool, cp_block_t *b) {
  cp_segment_t *seg = b->segment;
  cp_index_remove(&seg->stream->index[seg->kind], b);
  cp_free_removed_locked(pool, b);
}

void cp_block_make_live_locked(cp_pool_t *pool, cp_block_t *b, size_t requested) {
  cp_block_make_live_inline(pool, b, requested);
}

void cp_block_merge_free_locked(cp_pool_t *pool, cp_block_t *b) {
  b->state = CP_BLOCK_FREE;
  cp_block_t *p = b->prev;
  if (p != NULL && p->state == CP_BLOCK_FREE) { /* absorb b into its lower neighbour */
    cp_free_remove_locked(pool, p);
    cp_block_delete_locked(pool, cp_block_absorb_next(p));
    b = p;
  }
  cp_block_t *n = b->next;
  if (n != NULL && n->state == CP_BLOCK_FREE) { /* absorb the upper neighbour */
    cp_free_remove_locked(pool, n);
    cp_block_delete_locked(pool, cp_block_absorb_next(b));
  }
  cp_free_insert_locked(pool, b);
}

/* ------------------------------------------------------------------------------------------
 * Segments
 * ---------------------------------------------------------------------------------------- */

size_t cp_held_locked(const cp_pool_t *pool) { return cp_reserved_locked(pool) + pool->inflight_bytes; }

static void cp_segment_stats_locked(cp_pool_t *pool, const cp_segment_t *seg, int sign) {
  cp_stats_update(&pool->stats, CP_STAT_SEGMENT, seg->kind, sign);
  cp_stats_update(&pool->stats, CP_STAT_RESERVED_BYTES, seg->kind, sign * (int64_t)seg->size);
  if (seg->size >= pool->cfg.max_split_size) cp_stat_add(&pool->stats.oversize_segments, sign);
}

void cp_segment_link_locked(cp_pool_t *pool, cp_segment_t *seg) {
  if (seg->serial == 0) seg->serial = ++pool->segment_serials; /* kept when linked again */
  seg->prev = NULL;
  seg->next = pool->segments;
  if (pool->segments != NULL) pool->segments->prev = seg;
  pool->segments = seg;
  pool->segment_count++;
  if (!seg->paged) cp_segment_stats_locked(pool, seg, +1); /* paged: mapped bytes count, not segments */
}

void cp_segment_unlink_locked(cp_pool_t *pool, cp_segment_t *seg) {
  if (seg->prev != NULL)
    seg->prev->next = seg->next;
  else
    pool->segments = seg->next;
  if (seg->next != NULL) seg->next->prev = seg->prev;
  pool->segment_count--;
  if (!seg->paged) cp_segment_stats_locked(pool, seg, -1);
}

size_t cp_free_segments_detach_locked(cp_pool_t *pool, size_t want_bytes, cp_segment_t **out_list) {
  size_t bytes = 0;
  while (pool->free_segments_head != NULL) {
    cp_segment_t *seg = pool->free_segments_head; /* the one free the longest */
    cp_free_remove_locked(pool, seg->head);       /* also takes it off the free list */
    cp_segment_unlink_locked(pool, seg);
    seg->next = *out_list;
    *out_list = seg;
    bytes += seg->size;
    if (want_bytes != 0 && bytes >= want_bytes) break;
  }
  return bytes;
}
