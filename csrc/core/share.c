/* share.c — what another process must map to reach a live block (Note [Sharing a block]).
 * Owns: the description of a block for sharing, and its `shared` mark. */
#include <stdlib.h>
#include <string.h>

#include "core/expand.h"
#include "core/share.h"
#include "core/state.h"

/* Note [Sharing a block]
 * Another process reaches memory through the physical allocations behind it, never through
 * this pool: a plain segment is shared whole (the driver's IPC handle names a cuMemAlloc
 * allocation), page-mapped memory one handle at a time (a handle is mapped whole: cuMemMap's
 * offset is 0). So the description of a block is the segment holding it, or the handles that
 * hold its bytes, in address order: those of its page-mapped segment, cut at the handle edges
 * the segment records (Note [Handles follow growth] in expand.c), or, for a stitched block,
 * those of each run of its range in the range's order (each run is whole handles of the
 * segment it comes from). The receiver maps the same handles side by side at an address of its
 * own, so the block's bytes sit at the same offset from the first. The receiver's mapping
 * keeps the memory alive whatever this pool does later; that the block is not reused while the
 * receiver reads it is the caller's to ensure (torch keeps the sent tensor alive until every
 * receiver has let it go). A pause of the block's region would unmap memory the receiver still
 * holds and free nothing, so it is refused while the block is shared (pause.c); and a block of
 * a paused region has no memory behind it to share, so the share is refused until the resume. */

/* Append the handles over [lo, hi) of page-mapped segment `seg`, found at `va` onwards. */
static int cp_share_spans(cp_share_t *out, size_t *cap, const cp_segment_t *seg, uintptr_t lo, uintptr_t hi,
                          uintptr_t va) {
  for (uintptr_t cur = cp_expand_edge_down(seg, lo); cur < hi;) {
    uintptr_t end = cp_expand_edge_up(seg, cur + seg->chunk);
    if (end > seg->addr + seg->size) end = seg->addr + seg->size;
    if (out->span_count == *cap) {
      const size_t n = *cap ? *cap * 2 : 8;
      cp_share_span_t *grown = realloc(out->spans, n * sizeof *grown);
      if (grown == NULL) return cp_set_error(CP_ERR_HOST_OOM, "cudapool: share: no host memory");
      out->spans = grown;
      *cap = n;
    }
    out->spans[out->span_count++] = (cp_share_span_t){va + (cur - lo), end - cur};
    cur = end;
  }
  return CP_OK;
}

static int cp_share_describe_locked(const cp_block_t *b, cp_share_t *out) {
  const cp_segment_t *seg = b->segment;
  size_t cap = 0;
  int rc = CP_OK;
  if (seg->stitched) {
    out->paged = 1;
    uintptr_t va = seg->addr; /* the block starts the range (Note [Stitched ranges]) */
    for (size_t i = 0; i < seg->run_count && rc == CP_OK && va < b->addr + b->size; i++) {
      const cp_stitch_run_t *run = &seg->runs[i];
      rc = cp_share_spans(out, &cap, run->seg, run->addr, run->addr + run->size, va);
      va += run->size;
    }
  } else if (seg->paged) {
    out->paged = 1;
    const uintptr_t lo = cp_expand_edge_down(seg, b->addr);
    rc = cp_share_spans(out, &cap, seg, lo, b->addr + b->size, lo);
  } else {
    out->base = seg->addr;
    out->size = seg->size;
  }
  if (rc == CP_OK && out->paged) {
    out->base = out->spans[0].addr;
    const cp_share_span_t *last = &out->spans[out->span_count - 1];
    out->size = last->addr + last->size - out->base;
  }
  out->offset = b->addr - out->base;
  out->block_bytes = b->requested;
  return rc;
}

int cp_pool_share(cp_pool_t *pool, void *ptr, cp_share_t *out) {
  if (pool == NULL || out == NULL) return cp_set_error(CP_ERR_INVALID, "cp_pool_share: NULL argument");
  memset(out, 0, sizeof *out);
  pthread_mutex_lock(&pool->lock);
  cp_block_t *b = ptr != NULL ? cp_ptrmap_get(&pool->live, (uintptr_t)ptr) : NULL;
  int rc = CP_OK;
  if (b == NULL) {
    rc = cp_set_error(CP_ERR_INVALID, "cudapool: share: %p is not a live allocation of this pool", ptr);
  } else if (b->segment->stream->paused) {
    const char *name = cp_region_name(b->segment->stream->tag);
    rc = cp_set_error(CP_ERR_STATE,
                      "cudapool: share: %p is in region \"%s\", which is paused: its memory is not on the device "
                      "until the region is resumed (cudapool.resume)",
                      ptr, name != NULL ? name : "?");
  } else {
    rc = cp_share_describe_locked(b, out);
    if (rc == CP_OK) b->shared = 1;
  }
  pthread_mutex_unlock(&pool->lock);
  if (rc != CP_OK) cp_share_release(out);
  return rc;
}

int cp_pool_is_shared(cp_pool_t *pool, const void *ptr) {
  if (pool == NULL || ptr == NULL) return 0;
  pthread_mutex_lock(&pool->lock);
  const cp_block_t *b = cp_ptrmap_get(&pool->live, (uintptr_t)ptr);
  const int shared = b != NULL && b->shared;
  pthread_mutex_unlock(&pool->lock);
  return shared;
}

void cp_share_release(cp_share_t *s) {
  if (s == NULL) return;
  free(s->spans);
  memset(s, 0, sizeof *s);
}
