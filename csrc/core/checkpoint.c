/* checkpoint.c — checkpoints of a pool and their restore (Note [Checkpoints]).
 * Owns: the checkpoint records and the restore's carving of blocks at given addresses. */
#include <stdlib.h>
#include <string.h>

#include "core/block.h"
#include "core/capture.h"
#include "core/check.h"
#include "core/checkpoint.h"
#include "core/drain.h"
#include "core/history.h"
#include "core/oom.h"
#include "core/pool.h"

/* Note [Checkpoints]
 * What a CUDA graph tree needs of its private pool (torch's cudagraph trees:
 * getCheckpointState, setCheckpointPoolState, checkPoolLiveAllocations). A checkpoint records
 * the pool's segments and its live blocks: a block is live when it is allocated and its free
 * has not been asked for (a free waiting for the end of a capture, or for another stream's
 * events, is not live). Restoring it frees every block live now, waits for frees that wait
 * for other streams, and makes the checkpoint's live blocks live again at their addresses,
 * with their sizes and streams; what lies between them is free. It makes no device call and
 * gives nothing back, so work still queued on the memory (a graph replay) is untouched: the
 * bytes of a restored block are the ones the replay writes. Restoring fails, before it
 * changes anything, with CP_ERR_STATE when the checkpoint is of another pool, when a segment
 * it names is no longer held (given back since), when memory of a block it re-creates was
 * unmapped since or is paused, and while a capture window is open and a free would have to
 * wait for another stream. Pools that stitch pages cannot be checkpointed (CP_ERR_INVALID):
 * a stitched block's address is that of a range the pool may unmap at any later allocation,
 * so it could not be re-created there (graph pools never stitch). */

typedef struct cp_ck_segment_s {
  uintptr_t addr;
  size_t size;
  uint64_t serial; /* the same segment, not another reserved at its address since */
} cp_ck_segment_t;

typedef struct cp_ck_block_s {
  uintptr_t addr;
  size_t size;      /* the block's bytes */
  size_t requested; /* bytes asked for */
  size_t segment;   /* index into segments */
} cp_ck_block_t;

struct cp_checkpoint_s {
  const cp_pool_t *pool;
  cp_ck_segment_t *segments; /* address order */
  size_t segment_count;
  cp_ck_block_t *live; /* address order */
  size_t live_count;
};

/* Whether the LIVE block `b` is still in use: its free was not asked for (a free waiting for
 * the end of a capture leaves it LIVE, on the deferred list). */
static bool cp_ck_in_use_locked(const cp_pool_t *pool, const cp_block_t *b) {
  if (b->state != CP_BLOCK_LIVE) return false;
  for (size_t i = 0; i < pool->capture.deferred_count; i++) {
    if (pool->capture.deferred[i] == b) return false;
  }
  return true;
}

static int cp_ck_cmp_segment(const void *a, const void *b) {
  const uintptr_t x = ((const cp_ck_segment_t *)a)->addr, y = ((const cp_ck_segment_t *)b)->addr;
  return (x > y) - (x < y);
}

static int cp_ck_cmp_block(const void *a, const void *b) {
  const uintptr_t x = ((const cp_ck_block_t *)a)->addr, y = ((const cp_ck_block_t *)b)->addr;
  return (x > y) - (x < y);
}

static int cp_ck_cmp_ptr(const void *a, const void *b) {
  const uintptr_t x = (uintptr_t) * (void *const *)a, y = (uintptr_t) * (void *const *)b;
  return (x > y) - (x < y);
}

/* Blocks in use now, in no order (lock held): an array of *out_n, NULL when none. */
static int cp_ck_in_use_blocks_locked(const cp_pool_t *pool, cp_block_t ***out, size_t *out_n) {
  size_t n = 0;
  for (const cp_segment_t *seg = pool->segments; seg != NULL; seg = seg->next) {
    for (const cp_block_t *b = seg->head; b != NULL; b = b->next) n += cp_ck_in_use_locked(pool, b);
  }
  *out = NULL;
  *out_n = 0;
  if (n == 0) return CP_OK;
  cp_block_t **list = malloc(n * sizeof *list);
  if (list == NULL) return cp_set_error(CP_ERR_HOST_OOM, "cudapool: no host memory for a list of %zu blocks", n);
  size_t k = 0;
  for (cp_segment_t *seg = pool->segments; seg != NULL; seg = seg->next) {
    for (cp_block_t *b = seg->head; b != NULL; b = b->next) {
      if (cp_ck_in_use_locked(pool, b)) list[k++] = b;
    }
  }
  *out = list;
  *out_n = n;
  return CP_OK;
}

int cp_pool_checkpoint(cp_pool_t *pool, cp_checkpoint_t **out_ck) {
  if (pool == NULL || out_ck == NULL) return cp_set_error(CP_ERR_INVALID, "cp_pool_checkpoint: NULL argument");
  *out_ck = NULL;
  if (pool->cfg.page_stitching) {
    return cp_set_error(CP_ERR_INVALID,
                        "cudapool: checkpoint: a pool that stitches pages cannot be checkpointed (a stitched block "
                        "could not be re-created at its address); CUDA graph pools never stitch");
  }
  cp_checkpoint_t *ck = calloc(1, sizeof *ck);
  if (ck == NULL) return cp_set_error(CP_ERR_HOST_OOM, "cudapool: no host memory for a checkpoint");
  pthread_mutex_lock(&pool->lock);
  ck->pool = pool;
  cp_block_t **in_use = NULL;
  size_t live = 0;
  int rc = cp_ck_in_use_blocks_locked(pool, &in_use, &live);
  if (rc == CP_OK && pool->segment_count != 0) ck->segments = malloc(pool->segment_count * sizeof *ck->segments);
  if (rc == CP_OK && live != 0) ck->live = malloc(live * sizeof *ck->live);
  if (rc == CP_OK && ((pool->segment_count != 0 && ck->segments == NULL) || (live != 0 && ck->live == NULL))) {
    rc = cp_set_error(CP_ERR_HOST_OOM, "cudapool: no host memory for a checkpoint of %zu blocks", live);
  }
  if (rc == CP_OK) {
    for (const cp_segment_t *seg = pool->segments; seg != NULL; seg = seg->next) {
      ck->segments[ck->segment_count++] = (cp_ck_segment_t){seg->addr, seg->size, seg->serial};
    }
    for (size_t i = 0; i < live; i++) {
      const cp_block_t *b = in_use[i];
      ck->live[i] = (cp_ck_block_t){b->addr, b->size, b->requested, 0};
    }
    ck->live_count = live;
  }
  free(in_use);
  pthread_mutex_unlock(&pool->lock);
  if (rc != CP_OK) {
    cp_checkpoint_destroy(ck);
    return rc;
  }
  if (ck->segment_count > 1) qsort(ck->segments, ck->segment_count, sizeof *ck->segments, cp_ck_cmp_segment);
  if (ck->live_count > 1) qsort(ck->live, ck->live_count, sizeof *ck->live, cp_ck_cmp_block);
  /* Each live block's segment: both are in address order and segments do not overlap. */
  for (size_t i = 0, s = 0; i < ck->live_count; i++) {
    while (ck->segments[s].addr + ck->segments[s].size <= ck->live[i].addr) s++;
    ck->live[i].segment = s;
  }
  *out_ck = ck;
  return CP_OK;
}

void cp_checkpoint_destroy(cp_checkpoint_t *ck) {
  if (ck == NULL) return;
  free(ck->segments);
  free(ck->live);
  free(ck);
}

size_t cp_checkpoint_live_count(const cp_checkpoint_t *ck) { return ck != NULL ? ck->live_count : 0; }

void cp_checkpoint_live(const cp_checkpoint_t *ck, size_t i, void **out_ptr, size_t *out_size) {
  const bool ok = ck != NULL && i < ck->live_count;
  if (out_ptr != NULL) *out_ptr = ok ? (void *)ck->live[i].addr : NULL;
  if (out_size != NULL) *out_size = ok ? ck->live[i].requested : 0;
}

void cp_restore_release(cp_restore_t *r) {
  if (r == NULL) return;
  free(r->freed);
  free(r->made_live);
  free(r->made_live_sizes);
  memset(r, 0, sizeof *r);
}

/* The pool's segment the checkpoint recorded as `cs`, or NULL when it was given back (another
 * one may have been reserved at its address since: it holds other memory). */
static cp_segment_t *cp_ck_segment_locked(cp_pool_t *pool, const cp_ck_segment_t *cs) {
  for (cp_segment_t *seg = pool->segments; seg != NULL; seg = seg->next) {
    if (seg->addr == cs->addr && seg->size == cs->size && seg->serial == cs->serial) return seg;
  }
  return NULL;
}

/* The block of `seg` holding `addr`. */
static cp_block_t *cp_ck_block_at(cp_segment_t *seg, uintptr_t addr) {
  cp_block_t *b = seg->head;
  while (b != NULL && b->addr + b->size <= addr) b = b->next;
  return b;
}

/* Whether the bytes [addr, addr + size) of `seg` can be made live by a restore once the blocks
 * in use are freed and pending frees have completed: each block over them is in use, pending,
 * free or waiting to be unmapped (taken back), never unmapped or on its way. */
static bool cp_ck_restorable_locked(cp_segment_t *seg, uintptr_t addr, size_t size, const cp_block_t **out_bad) {
  for (const cp_block_t *b = cp_ck_block_at(seg, addr); b != NULL && b->addr < addr + size; b = b->next) {
    const int s = b->state;
    if (s != CP_BLOCK_LIVE && s != CP_BLOCK_PENDING && s != CP_BLOCK_FREE && s != CP_BLOCK_DRAINING) {
      *out_bad = b;
      return false;
    }
  }
  return true;
}

static const char *cp_ck_state_name(int state) {
  switch (state) {
    case CP_BLOCK_UNMAPPED: return "unmapped (given back to the device since)";
    case CP_BLOCK_MAPPING: return "being mapped";
    case CP_BLOCK_UNMAPPING: return "being unmapped";
    case CP_BLOCK_LENT: return "lent to a stitched block";
    default: return "not free";
  }
}

/* Everything that makes the restore impossible, found before anything changes. */
static int cp_ck_validate_locked(cp_pool_t *pool, const cp_checkpoint_t *ck, cp_block_t *const *in_use, size_t n) {
  if (ck->pool != pool) {
    return cp_set_error(CP_ERR_STATE, "cudapool: restore: the checkpoint was taken of another pool");
  }
  if (pool->paused_bytes != 0) {
    return cp_set_error(CP_ERR_STATE,
                        "cudapool: restore: a region of the pool is paused (%zu bytes): resume it before restoring a "
                        "checkpoint",
                        pool->paused_bytes);
  }
  for (size_t i = 0; i < n; i++) {
    const cp_block_t *b = in_use[i];
    if (b->use_count > 0 && cp_capture_must_defer_locked(pool, b)) {
      return cp_set_error(CP_ERR_STATE,
                          "cudapool: restore: the block at %p was used on another stream and a capture is under way: "
                          "its free cannot be tracked until the capture ends; restore after it",
                          (void *)b->addr);
    }
  }
  if ((pool->capture.deferred_count != 0 || pool->streams.pending_entries != 0) && pool->capture.windows != 0) {
    return cp_set_error(CP_ERR_STATE,
                        "cudapool: restore: frees of the pool wait for other streams and a capture window is open: "
                        "restore after it closes");
  }
  for (size_t i = 0; i < ck->live_count; i++) {
    const cp_ck_block_t *lb = &ck->live[i];
    const cp_ck_segment_t *cs = &ck->segments[lb->segment];
    cp_segment_t *seg = cp_ck_segment_locked(pool, cs);
    if (seg == NULL) {
      return cp_set_error(CP_ERR_STATE,
                          "cudapool: restore: the checkpoint's segment at %p (%zu bytes), which holds its block at %p, "
                          "is no longer held by the pool (it was given back since)",
                          (void *)cs->addr, cs->size, (void *)lb->addr);
    }
    const cp_block_t *bad = NULL;
    if (!cp_ck_restorable_locked(seg, lb->addr, lb->size, &bad)) {
      return cp_set_error(CP_ERR_STATE,
                          "cudapool: restore: the checkpoint's block at %p (%zu bytes) cannot be re-created: the "
                          "memory at %p is %s",
                          (void *)lb->addr, lb->size, (void *)bad->addr, cp_ck_state_name(bad->state));
    }
  }
  return CP_OK;
}

/* Make [addr, addr + size) of `seg`, inside one FREE block, a LIVE block of `requested`
 * bytes. CP_ERR_STATE when no FREE block covers it. */
static int cp_ck_carve_locked(cp_pool_t *pool, cp_segment_t *seg, const cp_ck_block_t *lb) {
  int rc = cp_reserve_metadata_locked(pool, 2);
  if (rc != CP_OK) return rc;
  /* Memory waiting to be unmapped, anywhere under the block, goes back into service first
   * (drain.c): it then merges with the free memory beside it. */
  for (const cp_block_t *d = cp_ck_block_at(seg, lb->addr); d != NULL && d->addr < lb->addr + lb->size; d = d->next) {
    if (d->state == CP_BLOCK_DRAINING) {
      cp_drain_revive_locked(pool, seg->stream);
      break;
    }
  }
  cp_block_t *b = cp_ck_block_at(seg, lb->addr);
  if (b == NULL || b->state != CP_BLOCK_FREE || b->addr + b->size < lb->addr + lb->size) {
    return cp_set_error(CP_ERR_STATE, "cudapool: restore: the memory of the checkpoint's block at %p is not free",
                        (void *)lb->addr);
  }
  cp_free_remove_locked(pool, b);
  if (b->addr < lb->addr) {
    cp_block_t *upper = cp_block_cut_locked(pool, b, lb->addr - b->addr);
    cp_free_insert_locked(pool, b);
    b = upper;
  }
  if (b->size > lb->size) {
    cp_block_t *rest = cp_block_cut_locked(pool, b, lb->size);
    cp_free_insert_locked(pool, rest);
  }
  cp_block_make_live_locked(pool, b, lb->requested);
  if (CP_UNLIKELY(pool->history != NULL)) {
    cp_history_alloc_locked(pool, CP_OK, (void *)b->addr, lb->requested, seg->stream->handle);
  }
  cp_evlog_put_locked(pool, CP_TRACE_ALLOC, b->addr, lb->requested, seg->stream->handle);
  return CP_OK;
}

int cp_pool_restore(cp_pool_t *pool, const cp_checkpoint_t *ck, cp_restore_t *out) {
  if (pool == NULL || ck == NULL || out == NULL) return cp_set_error(CP_ERR_INVALID, "cp_pool_restore: NULL argument");
  memset(out, 0, sizeof *out);
  if (ck->live_count != 0) {
    out->made_live = malloc(ck->live_count * sizeof *out->made_live);
    out->made_live_sizes = malloc(ck->live_count * sizeof *out->made_live_sizes);
    if (out->made_live == NULL || out->made_live_sizes == NULL) {
      cp_restore_release(out);
      return cp_set_error(CP_ERR_HOST_OOM, "cudapool: no host memory to restore %zu blocks", ck->live_count);
    }
  }
  pthread_mutex_lock(&pool->lock);
  if (pool->capture.windows == 0 && pool->capture.deferred_count != 0) cp_capture_flush_locked(pool);
  cp_block_t **in_use = NULL;
  size_t n = 0;
  int rc = cp_ck_in_use_blocks_locked(pool, &in_use, &n);
  if (rc == CP_OK) rc = cp_ck_validate_locked(pool, ck, in_use, n);
  /* 1. Free what is live now. A free that must wait for other streams records their events
   *    (validated: no capture stands in the way); a refused record leaves the block live. */
  if (rc == CP_OK && n != 0) {
    out->freed = malloc(n * sizeof *out->freed);
    if (out->freed == NULL) rc = cp_set_error(CP_ERR_HOST_OOM, "cudapool: no host memory to restore a checkpoint");
    for (size_t i = 0; i < n && rc == CP_OK; i++) {
      const uintptr_t addr = in_use[i]->addr;
      rc = cp_free_block_locked(pool, in_use[i], "restore");
      if (rc == CP_OK) out->freed[out->freed_count++] = (void *)addr;
    }
    if (out->freed_count > 1) qsort(out->freed, out->freed_count, sizeof *out->freed, cp_ck_cmp_ptr);
  }
  free(in_use);
  /* 2. Wait for frees that wait for other streams: their memory may be re-created. The lock
   *    is dropped meanwhile, so what was validated is validated again after. */
  const bool waited = rc == CP_OK && pool->streams.pending_entries != 0;
  if (waited) rc = cp_synchronize_pending_locked(pool);
  if (waited && rc == CP_OK) rc = cp_ck_validate_locked(pool, ck, NULL, 0);
  /* 3. The checkpoint's live blocks, where they were. */
  for (size_t i = 0; i < ck->live_count && rc == CP_OK; i++) {
    const cp_ck_block_t *lb = &ck->live[i];
    const cp_ck_segment_t *cs = &ck->segments[lb->segment];
    rc = cp_ck_carve_locked(pool, cp_ck_segment_locked(pool, cs), lb);
    if (rc == CP_OK) {
      out->made_live[out->made_live_count] = (void *)lb->addr;
      out->made_live_sizes[out->made_live_count] = lb->requested;
      out->made_live_count++;
    }
  }
  CP_DEBUG_CHECK(pool, "cp_pool_restore");
  pthread_mutex_unlock(&pool->lock);
  return rc;
}

int cp_pool_live_blocks(cp_pool_t *pool, void ***out_ptrs, size_t *out_count) {
  if (pool == NULL || out_ptrs == NULL || out_count == NULL) {
    return cp_set_error(CP_ERR_INVALID, "cp_pool_live_blocks: NULL argument");
  }
  pthread_mutex_lock(&pool->lock);
  cp_block_t **blocks = NULL;
  size_t n = 0;
  int rc = cp_ck_in_use_blocks_locked(pool, &blocks, &n);
  void **ptrs = rc == CP_OK && n != 0 ? malloc(n * sizeof *ptrs) : NULL;
  if (rc == CP_OK && n != 0 && ptrs == NULL) rc = cp_set_error(CP_ERR_HOST_OOM, "cudapool: no host memory");
  for (size_t i = 0; i < n && ptrs != NULL; i++) ptrs[i] = (void *)blocks[i]->addr;
  pthread_mutex_unlock(&pool->lock);
  free(blocks);
  if (rc != CP_OK) return rc;
  if (n > 1) qsort(ptrs, n, sizeof *ptrs, cp_ck_cmp_ptr);
  *out_ptrs = ptrs;
  *out_count = n;
  return CP_OK;
}
