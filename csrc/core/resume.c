/* resume.c — paused regions mapped again (Note [Paused regions] in pause.c), and what each
 * region of a pool holds. Owns: the pieces a resume maps and the regions' figures. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/check.h"
#include "core/expand.h"
#include "core/history.h"
#include "core/pause.h"
#include "core/snapshot.h"

/* ------------------------------------------------------------------------------------------
 * Resume
 * ---------------------------------------------------------------------------------------- */

/* One new page of a resume: [addr, addr + size) of `seg`. */
typedef struct cp_piece_s {
  cp_segment_t *seg;
  uintptr_t addr;
  size_t size;
  cp_page_t page; /* 0 until created */
  bool mapped;
} cp_piece_t;

/* One mapping of a stitched range at resume: `size` bytes at `off` in range `s`, the page of
 * piece `piece`, or the kept handle `page` of a stretch that was never unmapped. */
typedef struct cp_remap_s {
  cp_segment_t *s;
  size_t off;
  size_t size;
  size_t piece; /* SIZE_MAX: `page` */
  cp_page_t page;
  bool mapped;
} cp_remap_t;

/* The resume's plan for one state, and what it did so far. */
typedef struct cp_resume_s {
  cp_piece_t *pieces;
  size_t npieces, piece_cap;
  cp_remap_t *remaps;
  size_t nremaps, remap_cap;
  cp_segment_t **ranges; /* its paused stitched ranges */
  size_t nranges, range_cap;
  size_t mapped_ranges; /* ranges wholly mapped again */
  size_t maps, unmaps;
} cp_resume_t;

static int cp_resume_cmp_addr(const void *a, const void *b) {
  const uintptr_t x = *(const uintptr_t *)a, y = *(const uintptr_t *)b;
  return x < y ? -1 : x > y;
}

/* The pieces of span `sp` of `seg`: cut at the run edges of the paused ranges of the state and,
 * without kept handles, at every chunk edge. */
static int cp_resume_cut_locked(const cp_pool_t *pool, cp_resume_t *r, cp_segment_t *seg, const cp_span_t *sp) {
  const uintptr_t lo = sp->addr, hi = sp->addr + sp->size;
  uintptr_t *cuts = NULL;
  size_t nc = 0, cap = 0;
  int rc = cp_pause_grow((void **)&cuts, &cap, 2, sizeof *cuts);
  if (rc == CP_OK) {
    cuts[nc++] = lo;
    cuts[nc++] = hi;
  }
  if (rc == CP_OK && !pool->stitch) {
    for (uintptr_t a = lo + seg->chunk; a < hi && rc == CP_OK; a += seg->chunk) {
      rc = cp_pause_grow((void **)&cuts, &cap, nc + 1, sizeof *cuts);
      if (rc == CP_OK) cuts[nc++] = a;
    }
  }
  for (size_t i = 0; i < r->nranges && rc == CP_OK; i++) {
    const cp_segment_t *s = r->ranges[i];
    for (size_t j = 0; j < s->run_count && rc == CP_OK; j++) {
      const cp_stitch_run_t *run = &s->runs[j];
      if (run->seg != seg) continue;
      const uintptr_t edges[2] = {run->addr, run->addr + run->size};
      for (int e = 0; e < 2 && rc == CP_OK; e++) {
        if (edges[e] <= lo || edges[e] >= hi) continue;
        rc = cp_pause_grow((void **)&cuts, &cap, nc + 1, sizeof *cuts);
        if (rc == CP_OK) cuts[nc++] = edges[e];
      }
    }
  }
  if (rc == CP_OK) {
    qsort(cuts, nc, sizeof *cuts, cp_resume_cmp_addr);
    for (size_t i = 0; i + 1 < nc && rc == CP_OK; i++) {
      if (cuts[i + 1] == cuts[i]) continue;
      rc = cp_pause_grow((void **)&r->pieces, &r->piece_cap, r->npieces + 1, sizeof *r->pieces);
      if (rc == CP_OK) r->pieces[r->npieces++] = (cp_piece_t){seg, cuts[i], cuts[i + 1] - cuts[i], 0, false};
    }
  }
  free(cuts);
  return rc;
}

/* The mappings of paused range `s`, in its order. */
static int cp_resume_plan_range_locked(cp_resume_t *r, cp_segment_t *s) {
  size_t off = 0;
  int rc = CP_OK;
  for (size_t j = 0; j < s->run_count && rc == CP_OK; j++) {
    const cp_stitch_run_t *run = &s->runs[j];
    const cp_segment_t *seg = run->seg;
    const uintptr_t end = run->addr + run->size;
    for (uintptr_t a = run->addr, e; a < end && rc == CP_OK; a = e) {
      size_t piece = SIZE_MAX;
      for (size_t p = 0; p < r->npieces && piece == SIZE_MAX; p++) {
        if (r->pieces[p].seg == seg && r->pieces[p].addr == a) piece = p;
      }
      cp_page_t page = 0;
      if (piece != SIZE_MAX) {
        e = a + r->pieces[piece].size;
      } else { /* a stretch the pause could not unmap: its kept handles are still there */
        e = cp_expand_edge_up(seg, a + seg->chunk);
        const size_t slot = (a - seg->addr) / seg->chunk;
        page = slot < seg->page_slots ? seg->pages[slot] : 0;
        if (page == 0) return cp_set_error(CP_ERR_STATE, "cudapool: resume: a stitched range's page is unknown");
      }
      if (e > end) return cp_set_error(CP_ERR_STATE, "cudapool: resume: a stitched run does not end on a page");
      rc = cp_pause_grow((void **)&r->remaps, &r->remap_cap, r->nremaps + 1, sizeof *r->remaps);
      if (rc == CP_OK) r->remaps[r->nremaps++] = (cp_remap_t){s, off, e - a, piece, page, false};
      off += e - a;
    }
  }
  return rc;
}

static int cp_resume_plan_locked(cp_pool_t *pool, cp_stream_state_t *st, cp_resume_t *r) {
  int rc = CP_OK;
  for (cp_segment_t *s = pool->stitched; s != NULL && rc == CP_OK; s = s->next) {
    if (s->stream != st || !s->paused_range) continue;
    rc = cp_pause_grow((void **)&r->ranges, &r->range_cap, r->nranges + 1, sizeof *r->ranges);
    if (rc == CP_OK) r->ranges[r->nranges++] = s;
  }
  for (cp_segment_t *seg = pool->segments; seg != NULL && rc == CP_OK; seg = seg->next) {
    if (!seg->paged || seg->stream != st || seg->span_count == 0) continue;
    for (size_t i = 0; i < seg->span_count && rc == CP_OK; i++) rc = cp_resume_cut_locked(pool, r, seg, &seg->spans[i]);
    /* Kept handles: room to file the new ones. */
    if (rc == CP_OK && pool->stitch) {
      uintptr_t top = 0;
      for (size_t i = 0; i < seg->span_count; i++) {
        if (seg->spans[i].addr + seg->spans[i].size > top) top = seg->spans[i].addr + seg->spans[i].size;
      }
      if (cp_expand_page_slots_locked(seg, (top - seg->addr) / seg->chunk) != CP_OK) {
        rc = cp_set_error(CP_ERR_HOST_OOM, "cudapool: no host memory to resume a region");
      }
    }
  }
  for (size_t i = 0; i < r->nranges && rc == CP_OK; i++) rc = cp_resume_plan_range_locked(r, r->ranges[i]);
  return rc;
}

/* Undo what the device calls of a failed resume made (lock dropped): the mapped part of each
 * range (a prefix), the mapped pieces of each stretch (a prefix of its pieces), every page. */
static void cp_resume_undo(const cp_backend_t *be, cp_resume_t *r) {
  for (size_t i = 0; i < r->nranges; i++) {
    size_t mapped = 0;
    for (size_t k = 0; k < r->nremaps; k++)
      mapped += r->remaps[k].s == r->ranges[i] && r->remaps[k].mapped ? r->remaps[k].size : 0;
    if (mapped == 0) continue;
    (void)cp_pause_unmap_twice(be, r->ranges[i]->addr, mapped);
    r->unmaps++;
  }
  for (size_t p = 0; p < r->npieces;) {
    size_t q = p, bytes = 0;
    while (q < r->npieces && r->pieces[q].mapped && r->pieces[q].seg == r->pieces[p].seg &&
           r->pieces[q].addr == r->pieces[p].addr + bytes) {
      bytes += r->pieces[q].size;
      q++;
    }
    if (bytes != 0) {
      (void)cp_pause_unmap_twice(be, r->pieces[p].addr, bytes);
      r->unmaps++;
    }
    p = q > p ? q : p + 1;
  }
  for (size_t p = 0; p < r->npieces; p++) {
    if (r->pieces[p].page != 0) (void)be->page_release(be->ctx, r->pieces[p].page);
    r->pieces[p].page = 0;
  }
}

/* The device calls of a resume (lock dropped): a page per piece, mapped; access per stretch;
 * the ranges mapped again, access per range; the backups copied back. */
static int cp_resume_calls(const cp_backend_t *be, cp_resume_t *r, const cp_stream_state_t *st) {
  int rc = CP_OK;
  for (size_t p = 0; p < r->npieces && rc == CP_OK; p++) {
    cp_piece_t *pc = &r->pieces[p];
    rc = be->page_create(be->ctx, pc->size, &pc->page);
    if (rc != CP_OK) {
      pc->page = 0;
      break;
    }
    rc = be->page_map(be->ctx, pc->addr, pc->size, pc->page);
    r->maps++;
    pc->mapped = rc == CP_OK;
  }
  for (size_t p = 0; p < r->npieces && rc == CP_OK;) { /* one access call per stretch */
    size_t q = p, bytes = 0;
    while (q < r->npieces && r->pieces[q].seg == r->pieces[p].seg && r->pieces[q].addr == r->pieces[p].addr + bytes) {
      bytes += r->pieces[q].size;
      q++;
    }
    rc = be->page_set_access(be->ctx, r->pieces[p].addr, bytes);
    p = q;
  }
  for (size_t i = 0; i < r->nranges && rc == CP_OK; i++) {
    const cp_segment_t *s = r->ranges[i];
    size_t bytes = 0;
    for (size_t k = 0; k < r->nremaps && rc == CP_OK; k++) {
      cp_remap_t *m = &r->remaps[k];
      if (m->s != s) continue;
      const cp_page_t page = m->piece != SIZE_MAX ? r->pieces[m->piece].page : m->page;
      rc = be->page_map(be->ctx, s->addr + m->off, m->size, page);
      r->maps++;
      m->mapped = rc == CP_OK;
      bytes += m->size;
    }
    if (rc == CP_OK) rc = be->page_set_access(be->ctx, s->addr, bytes);
  }
  for (size_t b = 0; b < st->backup_count && rc == CP_OK; b++) {
    rc = be->copy_to_device(be->ctx, st->backups[b].addr, st->backups[b].host, st->backups[b].size);
  }
  return rc;
}

static void cp_resume_free(cp_resume_t *r) {
  free(r->pieces);
  free(r->remaps);
  free(r->ranges);
}

/* Resume one paused state (busy: no other pause or resume touches it). */
static int cp_resume_state_locked(cp_pool_t *pool, cp_stream_state_t *st) {
  cp_resume_t r = {0};
  int rc = cp_resume_plan_locked(pool, st, &r);
  const size_t bytes = st->paused_bytes;
  const size_t held = cp_held_locked(pool);
  if (rc == CP_OK && bytes != 0 && pool->cap_bytes != 0 &&
      (bytes > pool->cap_bytes || held > pool->cap_bytes - bytes)) {
    const char *name = cp_region_name(st->tag);
    rc = cp_set_error(CP_ERR_OOM, "cudapool: resume of region \"%s\" needs %zu bytes: memory cap of %zu bytes reached",
                      name != NULL ? name : "?", bytes, pool->cap_bytes);
  }
  if (rc != CP_OK) {
    cp_resume_free(&r);
    return rc;
  }
  const cp_backend_t *be = &pool->backend;
  pool->inflight_bytes += bytes;
  pthread_mutex_unlock(&pool->lock);
  rc = cp_resume_calls(be, &r, st);
  char why[512] = "";
  if (rc != CP_OK) {
    snprintf(why, sizeof why, "%s", cp_last_error());
    cp_resume_undo(be, &r);
  } else if (!pool->stitch) {
    /* Without kept handles each mapping keeps its memory (Note [Expandable segments]). */
    for (size_t p = 0; p < r.npieces; p++) (void)be->page_release(be->ctx, r.pieces[p].page);
  }
  pthread_mutex_lock(&pool->lock);
  pool->inflight_bytes -= bytes;
  pool->device_maps += r.maps;
  pool->device_unmaps += r.unmaps;
  if (rc != CP_OK) {
    const char *name = cp_region_name(st->tag);
    rc = cp_set_error(rc, "cudapool: resume of region \"%s\" (%zu bytes): %s; it stays paused",
                      name != NULL ? name : "?", bytes, why);
    cp_resume_free(&r);
    return rc;
  }
  for (size_t p = 0; p < r.npieces; p++) {
    const cp_piece_t *pc = &r.pieces[p];
    if (!pool->stitch) continue;
    for (uintptr_t a = pc->addr; a < pc->addr + pc->size; a += pc->seg->chunk)
      pc->seg->pages[(a - pc->seg->addr) / pc->seg->chunk] = pc->page;
  }
  for (cp_segment_t *seg = pool->segments; seg != NULL; seg = seg->next) {
    if (!seg->paged || seg->stream != st || seg->span_count == 0) continue;
    for (size_t i = 0; i < seg->span_count; i++) {
      const cp_span_t *sp = &seg->spans[i];
      cp_stats_inc(&pool->stats, CP_STAT_RESERVED_BYTES, seg->kind, sp->size);
      pool->stats.num_device_alloc++;
      CP_SEGMENT_EVENT(pool, CP_HIST_SEGMENT_MAP, sp->addr, sp->size, st->handle);
    }
    free(seg->spans);
    seg->spans = NULL;
    seg->span_count = seg->span_cap = 0;
    seg->paused = 0;
  }
  for (size_t i = 0; i < r.nranges; i++) {
    r.ranges[i]->mapped = r.ranges[i]->size;
    r.ranges[i]->paused_range = false;
  }
  pool->paused_bytes -= bytes;
  st->paused_bytes = 0;
  st->paused = false;
  const size_t now = cp_held_locked(pool);
  if (now > pool->high_water) pool->high_water = now;
  cp_pause_drop_backups_locked(pool, st);
  cp_resume_free(&r);
  return CP_OK;
}

/* One pass over the paused states of `tag`: each region all or nothing. */
static int cp_pool_resume_pass(cp_pool_t *pool, uint32_t tag) {
  pthread_mutex_lock(&pool->lock);
  int rc = pool->capture.windows != 0 ? cp_pause_refuse_locked(pool, "resume") : CP_OK;
  cp_stream_state_t **sts = NULL;
  size_t n = 0;
  if (rc == CP_OK) rc = cp_pause_take_states_locked(pool, tag, true, &sts, &n);
  for (size_t i = 0; i < n; i++) {
    const int r = cp_resume_state_locked(pool, sts[i]);
    if (r != CP_OK && rc == CP_OK) rc = r;
  }
  cp_pause_put_states_locked(sts, n);
  CP_DEBUG_CHECK(pool, "cp_pool_resume");
  pthread_mutex_unlock(&pool->lock);
  return rc;
}

/* Note [Resume's ladder]
 * A resume that finds no room fails only after the pool gave back what it caches: the free
 * memory of the regions that are not paused and of untagged memory (cp_empty_cache, which
 * waits for nothing but the frees whose streams are done, and does nothing during a capture),
 * then the regions still paused are tried once more. This is what a user would otherwise do by
 * hand (torch.cuda.empty_cache() before waking a model up). Regions resumed by the first pass
 * stay resumed; the error of the second says how much was given back. */
int cp_pool_resume(cp_pool_t *pool, uint32_t tag) {
  if (pool == NULL) return cp_set_error(CP_ERR_INVALID, "cp_pool_resume: NULL pool");
  int rc = cp_pool_resume_pass(pool, tag);
  if (rc != CP_ERR_OOM) return rc;
  char why[512];
  snprintf(why, sizeof why, "%s", cp_last_error());
  size_t allocated, before, after;
  cp_pool_usage(pool, &allocated, &before);
  if (cp_empty_cache(pool) != CP_OK) return cp_set_error(rc, "%s", why);
  cp_pool_usage(pool, &allocated, &after);
  if (after == before) return cp_set_error(rc, "%s (no cached memory to give back)", why);
  rc = cp_pool_resume_pass(pool, tag);
  if (rc != CP_ERR_OOM) return rc;
  snprintf(why, sizeof why, "%s", cp_last_error());
  return cp_set_error(rc, "%s (after giving back %zu bytes of cached memory)", why, before - after);
}

/* ------------------------------------------------------------------------------------------
 * What each region holds
 * ---------------------------------------------------------------------------------------- */

static cp_region_info_t *cp_region_slot(cp_region_info_t *out, size_t cap, size_t *n, uint32_t tag) {
  for (size_t i = 0; i < *n && i < cap; i++) {
    if (out[i].tag == tag) return &out[i];
  }
  const size_t i = (*n)++;
  if (i >= cap) return NULL;
  memset(&out[i], 0, sizeof out[i]);
  out[i].tag = tag;
  return &out[i];
}

static void cp_region_count_block(cp_region_info_t *ri, const cp_block_t *b) {
  if (b->state != CP_BLOCK_LIVE && b->state != CP_BLOCK_PENDING) return;
  ri->live_bytes += b->size;
  ri->live_blocks++;
}

size_t cp_pool_regions(cp_pool_t *pool, cp_region_info_t *out, size_t cap) {
  if (pool == NULL) return 0;
  pthread_mutex_lock(&pool->lock);
  size_t n = 0;
  /* Regions in the order of their tags: each tag once, however many streams serve it. */
  for (uint32_t tag = 1; tag <= CP_REGION_MAX; tag++) {
    for (size_t i = 0; i < pool->streams.count; i++) {
      const cp_stream_state_t *st = pool->streams.list[i];
      if (st->tag != tag) continue;
      cp_region_info_t *ri = cp_region_slot(out, cap, &n, tag);
      if (ri == NULL) continue;
      ri->paused |= st->paused;
      ri->paused_bytes += st->paused_bytes;
      ri->backup_bytes += st->backup_bytes;
      ri->streams++;
      for (const cp_segment_t *seg = pool->segments; seg != NULL; seg = seg->next) {
        if (seg->stream != st) continue;
        ri->segments++;
        ri->reserved += seg->paged ? seg->mapped - seg->paused : seg->size;
        for (const cp_block_t *b = seg->head; b != NULL; b = b->next) cp_region_count_block(ri, b);
      }
      for (const cp_segment_t *s = pool->stitched; s != NULL; s = s->next) {
        if (s->stream == st) cp_region_count_block(ri, s->head);
      }
    }
  }
  pthread_mutex_unlock(&pool->lock);
  return n;
}
