/* stitch_alloc.c — a large request served by stitching: the search for free pages a new range
 * can be made of, a kept range found again, a new range mapped (Note [Stitched ranges]).
 * Owns: the choice of pages and of kept ranges, and the device calls that make a range. */
#include <stdlib.h>

#include "core/expand.h"
#include "core/stitch_alloc.h"

#define CP_STITCH_TRIES 16

static size_t cp_pages_of(const cp_pool_t *pool, size_t bytes) {
  const size_t g = pool->vmm_granularity;
  return (bytes + g - 1) / g;
}

/* The block of `seg` that holds `addr`, walking from `from` when that is a block of `seg`
 * at or below `addr` (the runs of a range are in address order within each segment, so one
 * walk per segment serves them all). */
static cp_block_t *cp_stitch_block_at(const cp_segment_t *seg, uintptr_t addr, cp_block_t *from) {
  cp_block_t *b = from != NULL && from->segment == seg && from->addr <= addr ? from : seg->head;
  while (b != NULL && addr - b->addr >= b->size) b = b->next;
  return b;
}

/* The free pages of (st, large) segments a new range can be stitched from, as runs of whole
 * handles (Note [Handles in part use]): stretches of whole free handles, largest first, until
 * `want` pages (the last stretch taken up to the end of a handle, so the pages found may pass
 * `want`); when they fall short, the free last pages of a handle in part use as the first run
 * and its free first pages as the last one, those that complete the request with the fewest to
 * spare (else the largest). The runs chosen, in the range's order (whole stretches in address
 * order), in *out_runs (allocated, *out_n of them; the first one's `skip` set) and the blocks
 * that hold them in *out_blocks (allocated). Returns the pages found; 0, with nothing
 * allocated, when there is no free page or no host memory. Block pointers hold until the lock
 * drops. */

/* A candidate run: free whole pages from `addr + skip` on, `pages` of them. Whole handles have
 * end == 0; a handle in part use has its start at `addr`, its end at `end`, and either its
 * first pages free (skip 0: a last run) or its last ones (skip > 0: a first run). */
typedef struct cp_stitch_cand_s {
  cp_segment_t *seg;
  cp_block_t *block;
  uintptr_t addr;
  size_t pages;
  uintptr_t end;
  size_t skip;
  bool first; /* a handle in part use whose free pages end it: it can only open the range */
} cp_stitch_cand_t;

static int cp_stitch_cand_by_pages_desc(const void *a, const void *b) {
  const cp_stitch_cand_t *x = a, *y = b;
  if ((x->end != 0) != (y->end != 0)) return x->end != 0 ? 1 : -1; /* whole handles first */
  if (x->pages != y->pages) return x->pages > y->pages ? -1 : 1;
  return x->addr < y->addr ? -1 : x->addr > y->addr;
}

static int cp_stitch_cand_by_addr(const void *a, const void *b) {
  const cp_stitch_cand_t *x = a, *y = b;
  return x->addr < y->addr ? -1 : x->addr > y->addr;
}

static bool cp_stitch_cand_push(cp_stitch_cand_t **cand, size_t *n, size_t *cap, cp_stitch_cand_t c) {
  if (*n == *cap) {
    const size_t nc = *cap ? *cap * 2 : 64;
    cp_stitch_cand_t *grown = realloc(*cand, nc * sizeof *grown);
    if (grown == NULL) return false;
    *cand = grown;
    *cap = nc;
  }
  (*cand)[(*n)++] = c;
  return true;
}

/* Whether `addr` of `seg` lies on a page whose handle the pool holds. */
static bool cp_stitch_held(const cp_segment_t *seg, uintptr_t addr) {
  const size_t slot = (addr - seg->addr) / seg->chunk;
  return slot < seg->page_slots && seg->pages[slot] != 0;
}

/* Of the handles in part use cand[from..n) that may take the place `first` (or the last one),
 * and are not the handle `not`, the one for `missing` pages: SIZE_MAX when there is none. */
static size_t cp_stitch_pick_part(const cp_stitch_cand_t *cand, size_t from, size_t n, bool first, size_t missing,
                                  const cp_stitch_cand_t * not ) {
  size_t pick = SIZE_MAX;
  for (size_t i = from; i < n; i++) {
    const cp_stitch_cand_t *c = &cand[i];
    if (c->first != first || (not != NULL && c->seg == not ->seg && c->addr == not ->addr)) continue;
    if (pick == SIZE_MAX) {
      pick = i;
      continue;
    }
    const size_t have = cand[pick].pages;
    const bool fits = c->pages >= missing, pick_fits = have >= missing;
    if (fits ? !pick_fits || c->pages < have : !pick_fits && c->pages > have) pick = i;
  }
  return pick;
}

static size_t cp_stitch_gather_locked(cp_pool_t *pool, cp_stream_state_t *st, size_t want, cp_stitch_run_t **out_runs,
                                      cp_block_t ***out_blocks, size_t *out_n) {
  *out_runs = NULL;
  *out_blocks = NULL;
  *out_n = 0;
  const size_t g = pool->vmm_granularity;
  size_t ncand = 0, candcap = 0;
  cp_stitch_cand_t *cand = NULL;
  bool room = true;
  for (cp_segment_t *seg = pool->segments; seg != NULL && room; seg = seg->next) {
    if (!seg->paged || seg->stream != st || seg->kind != CP_KIND_LARGE) continue;
    for (cp_block_t *b = seg->head; b != NULL && room; b = b->next) {
      if (b->state != CP_BLOCK_FREE) continue;
      const uintptr_t b_end = b->addr + b->size;
      const uintptr_t lo = cp_expand_edge_up(seg, b->addr), hi = cp_expand_edge_down(seg, b_end);
      uintptr_t a = lo;
      while (a < hi && cp_stitch_held(seg, a)) {
        const uintptr_t e = cp_expand_edge_up(seg, a + g);
        if (e > hi) break;
        a = e;
      }
      if (a > lo)
        room = cp_stitch_cand_push(&cand, &ncand, &candcap,
                                   (cp_stitch_cand_t){.seg = seg, .block = b, .addr = lo, .pages = (a - lo) / g});
      /* The block starts inside a handle and runs to its end: that handle's free last pages. */
      if (lo > b->addr && lo <= b_end && room) {
        const uintptr_t hs = cp_expand_edge_down(seg, b->addr);
        const uintptr_t from = seg->addr + (b->addr - seg->addr + g - 1) / g * g;
        if (from < lo && cp_stitch_held(seg, hs))
          room = cp_stitch_cand_push(&cand, &ncand, &candcap,
                                     (cp_stitch_cand_t){seg, b, hs, (lo - from) / g, lo, from - hs, true});
      }
      /* The block ends inside a handle it starts or runs into: that handle's free first pages. */
      if (a == hi && hi < b_end && hi >= b->addr && (b_end - hi) / g > 0 && cp_stitch_held(seg, hi) && room)
        room = cp_stitch_cand_push(
            &cand, &ncand, &candcap,
            (cp_stitch_cand_t){seg, b, hi, (b_end - hi) / g, cp_expand_edge_up(seg, hi + g), 0, false});
    }
  }
  /* Largest stretches first: best fit takes the smallest free block that fits, so the large
   * ones stay free the longest, and a range stitched from them is the likeliest to find its
   * pages free again when it is next wanted. */
  if (ncand > 1) qsort(cand, ncand, sizeof *cand, cp_stitch_cand_by_pages_desc);
  size_t whole = 0;
  while (whole < ncand && cand[whole].end == 0) whole++;
  size_t found = 0, n = 0;
  for (size_t i = 0; i < whole && found < want; i++) {
    size_t take = cand[i].pages;
    if (found + take > want) { /* up to the end of the handle that holds the last page wanted */
      const uintptr_t e = cp_expand_edge_up(cand[i].seg, cand[i].addr + (want - found) * g);
      take = (e - cand[i].addr) / g;
    }
    cand[n] = cand[i];
    cand[n].pages = take;
    n++;
    found += take;
  }
  if (n > 1) qsort(cand, n, sizeof *cand, cp_stitch_cand_by_addr);
  /* Short of whole handles: handles in part use open and close the range. */
  cp_stitch_cand_t head = {0}, tail = {0};
  for (int k = 0; k < 2 && found < want && whole < ncand && pool->cfg.stitch_partial; k++) {
    const size_t missing = want - found;
    const size_t f = cp_stitch_pick_part(cand, whole, ncand, true, missing, tail.seg != NULL ? &tail : NULL);
    const size_t l = cp_stitch_pick_part(cand, whole, ncand, false, missing, head.seg != NULL ? &head : NULL);
    const bool can_f = head.seg == NULL && f != SIZE_MAX, can_l = tail.seg == NULL && l != SIZE_MAX;
    if (!can_f && !can_l) break;
    /* The one that completes the request, with fewer to spare; else the larger. */
    bool use_f = can_f;
    if (can_f && can_l) {
      const size_t pf = cand[f].pages, pl = cand[l].pages;
      use_f = (pf >= missing) != (pl >= missing) ? pf >= missing : pf >= missing ? pf <= pl : pf >= pl;
    }
    cp_stitch_cand_t *c = use_f ? &head : &tail;
    *c = cand[use_f ? f : l];
    found += c->pages < missing ? c->pages : missing;
  }
  const size_t nruns = n + (head.seg != NULL) + (tail.seg != NULL);
  cp_stitch_run_t *runs = nruns > 0 ? malloc(nruns * sizeof *runs) : NULL;
  cp_block_t **blocks = nruns > 0 ? malloc(nruns * sizeof *blocks) : NULL;
  if (runs == NULL || blocks == NULL) {
    free(runs);
    free(blocks);
    free(cand);
    return 0;
  }
  size_t r = 0;
  if (head.seg != NULL) {
    runs[r] = (cp_stitch_run_t){head.seg, head.addr, head.end - head.addr, NULL, head.skip};
    blocks[r++] = head.block;
  }
  for (size_t i = 0; i < n; i++) {
    runs[r] = (cp_stitch_run_t){cand[i].seg, cand[i].addr, cand[i].pages * g, NULL, 0};
    blocks[r++] = cand[i].block;
  }
  if (tail.seg != NULL) {
    runs[r] = (cp_stitch_run_t){tail.seg, tail.addr, tail.end - tail.addr, NULL, 0};
    blocks[r++] = tail.block;
  }
  free(cand);
  *out_runs = runs;
  *out_blocks = blocks;
  *out_n = nruns;
  return found;
}

/* Lend `size` bytes of the run `r` from its `skip` on out of the FREE block `b` that holds them:
 * b is cut around them and the middle becomes LENT. Needs two spare nodes. */
static void cp_stitch_lend_locked(cp_pool_t *pool, cp_stitch_run_t *r, cp_block_t *b, size_t size) {
  const uintptr_t at = r->addr + r->skip;
  cp_free_remove_locked(pool, b);
  cp_block_t *mid = b;
  if (b->addr < at) {
    mid = cp_block_cut_locked(pool, b, at - b->addr);
    cp_free_insert_locked(pool, b);
  }
  if (mid->size > size) cp_free_insert_locked(pool, cp_block_cut_locked(pool, mid, size));
  mid->state = CP_BLOCK_LENT;
  r->lent = mid;
}

/* Whether the pages behind the first `bytes` of `s` all lie in FREE blocks now (two runs may
 * share one). */
static bool cp_stitch_available_locked(const cp_segment_t *s, size_t bytes) {
  cp_block_t *b = NULL;
  for (size_t i = 0; i < s->run_count && bytes > 0; i++) {
    const cp_stitch_run_t *r = &s->runs[i];
    const size_t part = cp_stitch_part(r, bytes);
    b = cp_stitch_block_at(r->seg, r->addr + r->skip, b);
    if (b == NULL || b->state != CP_BLOCK_FREE || b->addr + b->size < r->addr + r->skip + part) return false;
    bytes -= part;
  }
  return bytes == 0;
}

/* Hand out the first `bytes` of the kept range `s` (available) as its block: the runs behind
 * them are lent, each out of the FREE block that holds it at that moment (lending one run
 * cuts blocks another may share). */
static void cp_stitch_take_locked(cp_pool_t *pool, cp_segment_t *s, size_t bytes, size_t size, void **out_ptr) {
  cp_block_t *at = NULL;
  s->head->addr = cp_stitch_block_addr(s);
  s->head->size = bytes;
  for (size_t i = 0; i < s->run_count && bytes > 0; i++) {
    cp_stitch_run_t *r = &s->runs[i];
    const size_t part = cp_stitch_part(r, bytes);
    cp_stitch_lend_locked(pool, r, cp_stitch_block_at(r->seg, r->addr + r->skip, at), part);
    at = r->lent;
    bytes -= part;
  }
  cp_block_make_live_locked(pool, s->head, size);
  *out_ptr = (void *)s->head->addr;
}

/* A kept range of `st` for `rounded` bytes whose pages are all free now, or NULL. */
static cp_segment_t *cp_stitch_find_kept_locked(cp_pool_t *pool, cp_stream_state_t *st, size_t rounded) {
  const size_t g = pool->vmm_granularity;
  const size_t need = cp_pages_of(pool, rounded) * g;
  /* Candidates in (size, age) order: after (above_size, above_born). */
  size_t above_size = 0;
  uint64_t above_born = 0;
  for (int tries = 0; tries < CP_STITCH_TRIES; tries++) {
    cp_segment_t *best = NULL;
    for (cp_segment_t *s = pool->stitched; s != NULL; s = s->next) {
      /* A range retired by the trim alone still serves its stream (stream order makes that
       * safe; its pages were never retired): taking it cancels the retirement. */
      const bool usable = !s->broken || (s->retired && s->trim_only);
      if (s->stream != st || s->head->state != CP_BLOCK_FREE || !usable || s->size < need) continue;
      if (tries > 0 && (s->size < above_size || (s->size == above_size && s->born <= above_born))) continue;
      if (best == NULL || s->size < best->size || (s->size == best->size && s->born < best->born)) best = s;
    }
    if (best == NULL) return NULL;
    if (cp_stitch_available_locked(best, need)) return best;
    above_size = best->size;
    above_born = best->born;
  }
  return NULL;
}

/* Map the pages of the runs `runs` side by side into a new range, and hand out its block.
 * The runs are lent before the lock is dropped, so no one else can take their pages. */
static int cp_stitch_new_locked(cp_pool_t *pool, cp_stream_state_t *st, cp_stitch_run_t *runs, cp_block_t **blocks,
                                size_t nruns, size_t need, size_t size, void **out_ptr) {
  const size_t g = pool->vmm_granularity;
  size_t bytes = 0;
  for (size_t i = 0; i < nruns; i++) bytes += runs[i].size;
  cp_segment_t *s = calloc(1, sizeof *s);
  /* The handles to map, in order, and the bytes of each (a handle is mapped whole). */
  cp_page_t *pages = malloc(bytes / g * sizeof *pages);
  size_t *lens = malloc(bytes / g * sizeof *lens);
  size_t nhandles = 0;
  if (lens == NULL) {
    free(pages);
    pages = NULL;
  }
  int rc = s != NULL && pages != NULL ? cp_reserve_metadata_locked(pool, (int)(2 * nruns + 1)) : CP_ERR_HOST_OOM;
  if (rc != CP_OK) {
    free(s);
    free(pages);
    free(runs);
    return rc == CP_ERR_HOST_OOM ? cp_set_error(rc, "cudapool: no host memory to stitch pages") : rc;
  }
  s->stitched = true;
  s->stream = st;
  s->kind = CP_KIND_LARGE;
  s->size = bytes;
  s->runs = runs;
  s->run_count = nruns;
  for (size_t i = 0; i < nruns; i++) {
    const cp_segment_t *seg = runs[i].seg;
    for (uintptr_t a = runs[i].addr, e; a < runs[i].addr + runs[i].size; a = e) {
      e = cp_expand_edge_up(seg, a + g);
      pages[nhandles] = seg->pages[(a - seg->addr) / g];
      lens[nhandles++] = e - a;
    }
  }
  /* Lend the bytes the block will cover: whole runs, and the first bytes of the last (a handle
   * in part use has no more free). Two runs may lie in one free block: each is found anew. */
  for (size_t i = 0, left = need; i < nruns && left > 0; i++) {
    const size_t part = cp_stitch_part(&runs[i], left);
    const uintptr_t at = runs[i].addr + runs[i].skip;
    cp_block_t *b = blocks[i]->state == CP_BLOCK_FREE && at - blocks[i]->addr < blocks[i]->size
                        ? blocks[i]
                        : cp_stitch_block_at(runs[i].seg, at, NULL);
    cp_stitch_lend_locked(pool, &runs[i], b, part);
    left -= part;
  }

  const cp_backend_t *be = &pool->backend;
  pool->stitch_inflight += need; /* lent, and on no list yet: the checker counts them here */
  pthread_mutex_unlock(&pool->lock);
  uintptr_t addr = 0;
  size_t mapped = 0, maps = 0;
  rc = be->va_reserve(be->ctx, bytes, &addr);
  for (size_t h = 0; rc == CP_OK && h < nhandles; h++) {
    rc = be->page_map(be->ctx, addr + mapped, lens[h], pages[h]);
    if (rc == CP_OK) {
      mapped += lens[h];
      maps++;
    }
  }
  if (rc == CP_OK) rc = be->page_set_access(be->ctx, addr, bytes);
  pthread_mutex_lock(&pool->lock);
  free(pages);
  free(lens);
  pool->device_maps += maps;
  if (rc != CP_OK) {
    char msg[448];
    snprintf(msg, sizeof msg, "%s", cp_last_error());
    /* The undo lets go of the lock again: the runs stay counted as being stitched until they
     * are given back (the checker, and a pause waiting for stitches under way, see them). */
    const int undo = addr != 0 ? cp_stitch_unmap_locked(pool, addr, bytes, &mapped) : CP_OK;
    pool->stitch_inflight -= need;
    cp_stitch_return_locked(pool, s);
    if (undo != CP_OK) {
      /* Not undone (pages still mapped there, or its address range not given back): keep it
       * as a broken idle range, so that the next drop gives back what the device holds. */
      s->addr = addr;
      (void)cp_segment_head_locked(pool, s, CP_BLOCK_FREE);
      s->mapped = mapped;
      s->broken = true;
      cp_stitch_link_locked(pool, s);
    } else {
      cp_stitch_free_range(pool, s);
    }
    /* Growth may still serve the request: stitching only failed to reuse pages. */
    return cp_set_error(CP_ERR_OOM, "cudapool: stitching pages failed: %s", msg);
  }
  pool->stitch_inflight -= need;
  s->addr = addr;
  s->mapped = bytes;
  cp_block_t *head = cp_segment_head_locked(pool, s, CP_BLOCK_FREE);
  cp_stitch_link_locked(pool, s);
  s->born = ++pool->stitches;
  head->addr = cp_stitch_block_addr(s); /* whole handles are mapped around the block */
  head->size = need;
  cp_block_make_live_locked(pool, head, size);
  *out_ptr = (void *)head->addr;
  return CP_OK;
}

int cp_stitch_alloc_locked(cp_pool_t *pool, cp_stream_state_t *st, size_t rounded, size_t size, bool past_keep,
                           void **out_ptr, bool *out_full) {
  *out_full = false;
  const size_t g = pool->vmm_granularity;
  const size_t want = cp_pages_of(pool, rounded);
  if (want < 2) return CP_ERR_OOM; /* one page: a free one would have fitted */

  /* Asked again after a trim: the kept ranges were searched already. */
  cp_segment_t *kept = past_keep ? NULL : cp_stitch_find_kept_locked(pool, st, rounded);
  if (kept != NULL) {
    int rc = cp_reserve_metadata_locked(pool, (int)(2 * kept->run_count));
    if (rc == CP_OK) {
      if (kept->retired) { /* trimmed, still mapped: back in service */
        kept->retired = kept->broken = kept->trim_only = false;
        pool->retired_ranges--;
      }
      cp_stitch_take_locked(pool, kept, want * g, size, out_ptr);
      pool->stitch_reuses++;
    }
    return rc;
  }

  cp_stitch_run_t *runs = NULL;
  cp_block_t **blocks = NULL;
  size_t n = 0;
  size_t found = cp_stitch_gather_locked(pool, st, want, &runs, &blocks, &n);
  if (found < want) {
    free(runs);
    free(blocks);
    /* Top up: map the missing pages when that costs fewer new pages than growing would. */
    if (found == 0 || past_keep) return CP_ERR_OOM; /* after a trim: others took pages meanwhile */
    cp_block_t *c = cp_expand_find_locked(pool, st, CP_KIND_LARGE, rounded);
    const size_t have = c != NULL && c->state == CP_BLOCK_FREE ? c->size : 0;
    const size_t grow_pages = cp_pages_of(pool, rounded - have);
    const size_t missing = want - found;
    if (c == NULL || missing >= grow_pages) return CP_ERR_OOM;
    cp_block_t *u = c->state == CP_BLOCK_UNMAPPED ? c : c->next;
    if (u == NULL || u->state != CP_BLOCK_UNMAPPED || u->size < (missing + (u->next == NULL)) * g) return CP_ERR_OOM;
    cp_block_t *m = NULL;
    int rc = cp_expand_map_locked(pool, u, missing * g, &m);
    if (rc == CP_OK) rc = cp_expand_refuse_paused(st); /* the lock was let go: a pause may have begun */
    if (rc != CP_OK) return rc;
    found = cp_stitch_gather_locked(pool, st, want, &runs, &blocks, &n);
  }
  if (found >= want && !past_keep && pool->stitched_count - pool->retired_ranges >= CP_STITCH_KEEP) {
    /* Room for one more kept range first (the caller trims, and asks again). */
    free(runs);
    free(blocks);
    *out_full = true;
    return CP_ERR_OOM;
  }
  if (found < want) { /* others took pages meanwhile: grow instead */
    free(runs);
    free(blocks);
    return CP_ERR_OOM;
  }
  int rc = cp_stitch_new_locked(pool, st, runs, blocks, n, want * g, size, out_ptr);
  free(blocks);
  return rc;
}
