/* stitch.c — stitched ranges: free pages of a stream's page-mapped segments, mapped side by
 * side at a fresh address for a large request no free block fits, and kept for reuse.
 * Owns: the list of stitched ranges and their life once made (their LENT blocks given back,
 * retirement, revival, unmapping and drops, the pages they alias), and their check. Making
 * one, and choosing one for a request, is stitch_alloc.c's. */
#include <stdlib.h>

#include "core/capture.h"
#include "core/stitch.h"

/* Note [Stitched ranges] and Note [Handles in part use] are in stitch.h. */

void cp_stitch_return_locked(cp_pool_t *pool, cp_segment_t *s) {
  for (size_t i = 0; i < s->run_count; i++) {
    cp_block_t *b = s->runs[i].lent;
    if (b == NULL) continue;
    s->runs[i].lent = NULL;
    cp_block_merge_free_locked(pool, b);
  }
}

static void cp_stitch_unlink_locked(cp_pool_t *pool, cp_segment_t *s) {
  if (s->prev != NULL)
    s->prev->next = s->next;
  else
    pool->stitched = s->next;
  if (s->next != NULL) s->next->prev = s->prev;
  s->prev = s->next = NULL;
  pool->stitched_count--;
  pool->stitched_space -= s->size;
}

void cp_stitch_link_locked(cp_pool_t *pool, cp_segment_t *s) {
  s->prev = NULL;
  s->next = pool->stitched;
  if (pool->stitched != NULL) pool->stitched->prev = s;
  pool->stitched = s;
  pool->stitched_count++;
  pool->stitched_space += s->size;
}

int cp_stitch_unmap_locked(cp_pool_t *pool, uintptr_t addr, size_t size, size_t *mapped) {
  const cp_backend_t *be = &pool->backend;
  const size_t bytes = *mapped;
  pthread_mutex_unlock(&pool->lock);
  int rc = bytes != 0 ? be->page_unmap(be->ctx, addr, bytes) : CP_OK;
  if (rc == CP_OK) {
    *mapped = 0;
    rc = be->va_free(be->ctx, addr, size);
  }
  pthread_mutex_lock(&pool->lock);
  if (bytes != 0) pool->device_unmaps++;
  return rc;
}

void cp_stitch_free_range(cp_pool_t *pool, cp_segment_t *s) {
  if (s->head != NULL) cp_block_delete_locked(pool, s->head);
  free(s->runs);
  free(s);
}

/* Drop the idle range `s` (on the list, its block FREE): unmap it, give back its addresses. */
static int cp_stitch_drop_locked(cp_pool_t *pool, cp_segment_t *s) {
  cp_stitch_unlink_locked(pool, s);
  if (s->retired) pool->retired_ranges--;
  s->retired = s->trim_only = false;
  int rc = cp_stitch_unmap_locked(pool, s->addr, s->size, &s->mapped);
  if (rc != CP_OK) {
    /* Keep it: still mapped, as it was, or unmapped with its address range still held. It
     * never serves again; the next drop gives back what the device holds. */
    s->broken = true;
    cp_stitch_link_locked(pool, s);
    return rc;
  }
  cp_stitch_free_range(pool, s);
  return CP_OK;
}

size_t cp_stitch_retire_idle_locked(cp_pool_t *pool, cp_stream_state_t *st) {
  size_t n = 0;
  for (cp_segment_t *s = pool->stitched; s != NULL; s = s->next) {
    if (s->stream != st || s->head->state != CP_BLOCK_FREE) continue;
    s->trim_only = false; /* its pages may be retired now too: it never serves again */
    if (s->retired) continue;
    s->retired = true;
    s->broken = true;
    pool->retired_ranges++;
    n++;
  }
  return n;
}

void cp_stitch_revive_locked(cp_pool_t *pool, cp_stream_state_t *st) {
  for (cp_segment_t *s = pool->stitched; s != NULL; s = s->next) {
    if (s->stream != st || !s->retired) continue;
    s->retired = false;
    s->trim_only = false;
    s->broken = s->mapped != s->size;
    pool->retired_ranges--;
  }
}

int cp_stitch_drop_retired_locked(cp_pool_t *pool, cp_stream_state_t *st, bool *out_left) {
  int first_rc = CP_OK;
  *out_left = false;
  /* Each drop lets go of the lock: walk again from the start, past the ranges that failed. */
  for (bool progress = true; progress;) {
    progress = false;
    for (cp_segment_t *s = pool->stitched; s != NULL; s = s->next) {
      if (s->stream != st || s->head->state != CP_BLOCK_FREE || !(s->retired || s->broken)) continue;
      if (!s->retired && s->release_failed) continue; /* failed in this call already */
      const int rc = cp_stitch_drop_locked(pool, s);
      if (rc != CP_OK) {
        s->release_failed = true;
        if (first_rc == CP_OK) first_rc = rc;
      }
      progress = true;
      break;
    }
  }
  for (cp_segment_t *s = pool->stitched; s != NULL; s = s->next) {
    if (s->stream != st) continue;
    if (s->release_failed && s->mapped != 0) *out_left = true;
    s->release_failed = false;
  }
  return first_rc;
}

uintptr_t cp_stitch_alias_from_locked(const cp_pool_t *pool, const cp_segment_t *seg, uintptr_t lo, uintptr_t hi) {
  uintptr_t first = hi;
  for (const cp_segment_t *s = pool->stitched; s != NULL; s = s->next) {
    const cp_block_t *b = s->head;
    if (s->stream != seg->stream || (b->state != CP_BLOCK_LIVE && b->state != CP_BLOCK_PENDING)) continue;
    const size_t lead = s->runs[0].skip, tail = lead + b->size; /* the block, from the range's start */
    size_t off = 0;                                             /* the runs' bytes from the range's start */
    for (size_t i = 0; i < s->run_count && off < s->mapped; off += s->runs[i].size, i++) {
      const cp_stitch_run_t *r = &s->runs[i];
      if (r->seg != seg) continue;
      const size_t end = off + r->size < s->mapped ? off + r->size : s->mapped; /* a broken range maps less */
      /* The run's parts outside the block: before it (a first run's skip) and past it. */
      const size_t parts[2][2] = {{off, end < lead ? end : lead}, {off > tail ? off : tail, end}};
      for (int k = 0; k < 2; k++) {
        if (parts[k][0] >= parts[k][1]) continue;
        const uintptr_t a = r->addr + (parts[k][0] - off), e = r->addr + (parts[k][1] - off);
        if (a < hi && e > lo) first = a > lo ? (a < first ? a : first) : lo;
      }
    }
  }
  return first;
}

cp_stream_state_t *cp_stitch_retire_lru_locked(cp_pool_t *pool, cp_stream_state_t *st) {
  cp_segment_t *lru = NULL;
  for (cp_segment_t *s = pool->stitched; s != NULL; s = s->next) {
    if (s->head->state == CP_BLOCK_FREE && !s->broken && !s->stream->reaping && !s->stream->paused &&
        (lru == NULL || s->last_use < lru->last_use))
      lru = s;
  }
  if (lru == NULL || (lru->stream != st && cp_capturing_locked(pool, lru->stream->handle))) return NULL;
  lru->retired = true;
  lru->broken = true;
  lru->trim_only = true;
  pool->retired_ranges++;
  return lru->stream;
}

void cp_stitch_release_locked(cp_pool_t *pool, cp_block_t *b) {
  cp_segment_t *s = b->segment;
  b->state = CP_BLOCK_FREE;
  b->addr = s->addr; /* idle, the block covers the range again */
  b->size = s->size;
  cp_stitch_return_locked(pool, s);
  s->last_use = ++pool->stitch_clock;
}

void cp_stitch_destroy(cp_pool_t *pool) {
  const cp_backend_t *be = &pool->backend;
  for (cp_segment_t *s = pool->stitched, *next; s != NULL; s = next) {
    next = s->next;
    if (s->mapped != 0) be->page_unmap(be->ctx, s->addr, s->mapped);
    be->va_free(be->ctx, s->addr, s->size);
    free(s->head->uses);
    free(s->runs);
    free(s);
  }
  pool->stitched = NULL;
}

#define CP_VIOLATION(...)                       \
  do {                                          \
    v++;                                        \
    if (out != NULL) {                          \
      fprintf(out, "  stitched: " __VA_ARGS__); \
      fputc('\n', out);                         \
    }                                           \
  } while (0)

size_t cp_stitch_check_locked(cp_pool_t *pool, FILE *out, size_t *live, size_t *live_bytes, size_t *active,
                              size_t *active_bytes, size_t *requested, size_t *lent_bytes) {
  size_t v = 0, count = 0, space = 0;
  for (cp_segment_t *s = pool->stitched; s != NULL; s = s->next) {
    count++;
    space += s->size;
    const cp_block_t *b = s->head;
    bool lent = b != NULL && (b->state == CP_BLOCK_LIVE || b->state == CP_BLOCK_PENDING);
    if (!s->stitched || s->paged || b == NULL || b->segment != s || b->prev != NULL || b->next != NULL ||
        s->run_count == 0 || b->addr != (lent ? cp_stitch_block_addr(s) : s->addr) || b->size == 0 ||
        b->addr + b->size > s->addr + s->size || (!lent && b->size != s->size)) {
      CP_VIOLATION("range %#lx: not one block at its start (covering it when idle)", (unsigned long)s->addr);
      continue;
    }
    /* In use, the runs behind the block's bytes are lent, in order, and no other. */
    size_t runs = 0, to_lend = lent ? b->size : 0;
    const bool paused = s->paused_range && s->mapped == 0 && !s->broken && s->stream->paused;
    if (s->mapped > s->size || (!paused && (s->mapped != s->size || s->broken) && (!s->broken || lent)))
      CP_VIOLATION("range %#lx: %zu of %zu bytes mapped (%s), its block in state %d", (unsigned long)s->addr, s->mapped,
                   s->size, s->broken ? "broken" : "whole", b->state);
    for (size_t i = 0; i < s->run_count; i++) {
      const cp_stitch_run_t *r = &s->runs[i];
      runs += r->size;
      if (r->skip != 0 && (i != 0 || r->skip >= r->size)) {
        CP_VIOLATION("range %#lx: run %zu skips %zu of its %zu bytes", (unsigned long)s->addr, i, r->skip, r->size);
        continue;
      }
      const size_t part = cp_stitch_part(r, to_lend);
      to_lend -= part;
      if ((r->lent != NULL) != (part != 0)) {
        CP_VIOLATION("range %#lx: run %zu is %slent while %zu of its bytes are in use", (unsigned long)s->addr, i,
                     r->lent != NULL ? "" : "not ", part);
      } else if (r->lent != NULL && (r->lent->state != CP_BLOCK_LENT || r->lent->addr != r->addr + r->skip ||
                                     r->lent->size != part || r->lent->segment != r->seg)) {
        CP_VIOLATION("range %#lx: run %zu does not match its LENT block", (unsigned long)s->addr, i);
      }
    }
    if (runs != s->size) CP_VIOLATION("range %#lx: runs hold %zu of %zu bytes", (unsigned long)s->addr, runs, s->size);
    if (to_lend != 0)
      CP_VIOLATION("range %#lx: its runs hold %zu bytes fewer than its block", (unsigned long)s->addr, to_lend);
    const bool plan_range = b->plan == CP_PLAN_RANGE; /* a step plan's: counted by its nodes (check.c) */
    if (b->state == CP_BLOCK_LIVE && !plan_range) {
      (*live)++;
      *live_bytes += b->size;
      if (cp_ptrmap_get(&pool->live, b->addr) != b)
        CP_VIOLATION("range %#lx: live but not in the live map", (unsigned long)s->addr);
    } else if (b->state != CP_BLOCK_PENDING && b->state != CP_BLOCK_FREE && !plan_range) {
      CP_VIOLATION("range %#lx: bad state %d", (unsigned long)s->addr, b->state);
    }
    if (lent) {
      if (!plan_range) {
        (*active)++;
        *active_bytes += b->size;
        *requested += b->requested;
      }
      *lent_bytes += b->size;
    }
  }
  if (count != pool->stitched_count || space != pool->stitched_space)
    CP_VIOLATION("%zu ranges (%zu bytes), counts say %zu (%zu)", count, space, pool->stitched_count,
                 pool->stitched_space);
  return v;
}
