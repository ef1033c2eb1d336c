/* plan.c — the step plan in service, Note [Learning the step] (plan_types.h): arming a plan
 * the learning found, adopting it in the pool's free memory, serving it by position, losing,
 * dropping and giving it up. Owns: pool->plan (the log is plan_learn.c's) and its nodes. */
#include <stdlib.h>
#include <string.h>

#include "core/block.h"
#include "core/expand.h"
#include "core/plan.h"
#include "core/plan_learn.h"
#include "core/sizes.h"
#include "core/stitch.h"

/* Tuning, may be modified: */
#define CP_PLAN_MAX_EXTRA    16u /* allocations off the plan per step before it is lost */
#define CP_PLAN_MAX_LOSSES   3u  /* losses in a row that drop the plan */
#define CP_PLAN_OVERFLOW_BIN UINT32_MAX

/* The statistics an allocation counts in: the overflow range taken from the ladder is the
 * plan's, not an allocation, so it leaves them (CP_PLAN_FAMILIES of them, in pl->saved). */
static const int cp_plan_alloc_families[CP_PLAN_FAMILIES] = {
    CP_STAT_ALLOCATION, CP_STAT_ALLOCATED_BYTES, CP_STAT_ACTIVE, CP_STAT_ACTIVE_BYTES, CP_STAT_REQUESTED_BYTES};

/* A block leaving the plan back to its source, its figures already out of the stats: a
 * stitched range's block to its range, any other merged into its segment's free index. */
static void cp_plan_return_block_locked(cp_pool_t *pool, cp_block_t *b) {
  b->requested = 0;
  b->use_count = 0;
  cp_stitch_give_back_locked(pool, b);
}

void cp_plan_watch_block_locked(cp_pool_t *pool, void *ptr, uint64_t watch) {
  cp_block_t *b = cp_ptrmap_get(&pool->live, (uintptr_t)ptr);
  if (b != NULL) b->plan_seq = watch;
}

/* The learning found period `p` at its last record: plan it without the lock, then arm. */
static void cp_plan_make_locked(cp_pool_t *pool, uint32_t p) {
  cp_plan_t *pl = &pool->plan;
  cp_plan_work_t w = {.count = p};
  uint64_t first_number = 0;
  if (!cp_plan_learn_window(pl, p, &w, &first_number)) return; /* learning goes on */
  pl->state = CP_PLAN_PLANNING;
  pthread_mutex_unlock(&pool->lock);
  const uint64_t t0 = cp_plan_now_ns();
  const int rc = cp_plan_compute(&w);
  const uint64_t spent = cp_plan_now_ns() - t0;
  free(w.rec);
  pthread_mutex_lock(&pool->lock);
  pl->plan_ns += spent;
  if (pl->state != CP_PLAN_PLANNING || rc != CP_OK || w.planned == 0) {
    free(w.entries);
    free(w.due);
    free(w.arcs);
    if (pl->state == CP_PLAN_PLANNING) {
      pl->state = CP_PLAN_LEARNING;
      pl->min_period = p; /* nothing to plan at this period: look for a longer one */
      cp_plan_learn_reset(pl);
    }
    return;
  }
  pl->entries = w.entries;
  pl->due = w.due;
  pl->arcs = w.arcs;
  pl->arc_count = w.planned;
  pl->period = w.period;
  pl->count = p;
  pl->adopt_tries = 0;
  pl->last_planned = w.planned;
  pl->last_count = p;
  pl->armed_at = first_number + w.origin; /* the first period's origin: a position 0 */
  pl->state = CP_PLAN_ARMED;
}

/* ------------------------------------------------------------------------------------------
 * Serving, losing, dropping
 * ---------------------------------------------------------------------------------------- */

/* The stream lists of the plan's nodes (record_stream), before its arrays go. */
static void cp_plan_free_arrays(cp_plan_t *pl) {
  for (uint32_t j = 0; pl->entries != NULL && j < pl->count; j++) free(pl->entries[j].node.uses);
}

/* Back to learning from scratch: the plan's arrays are gone. */
static void cp_plan_relearn_locked(cp_plan_t *pl) {
  cp_plan_free_arrays(pl);
  free(pl->entries);
  free(pl->due);
  free(pl->arcs);
  free(pl->bins);
  pl->entries = NULL;
  pl->due = NULL;
  pl->arcs = NULL;
  pl->bins = NULL;
  pl->count = pl->arc_count = pl->bin_count = 0;
  pl->range_bytes = 0;
  pl->state = CP_PLAN_LEARNING;
  cp_plan_learn_reset(pl);
}

/* The bins back to the pool (no planned node is in use): free blocks again, merged and
 * indexed. They were never in the allocation stats. */
static void cp_plan_return_bins_locked(cp_pool_t *pool) {
  cp_plan_t *pl = &pool->plan;
  for (uint32_t i = 0; i < pl->bin_count; i++) {
    pl->bins[i]->plan = 0;
    cp_plan_return_block_locked(pool, pl->bins[i]);
  }
  cp_plan_relearn_locked(pl);
}

/* Stop serving; the bins go back once nothing planned is in use. */
static void cp_plan_drop_locked(cp_pool_t *pool, uint32_t min_period) {
  cp_plan_t *pl = &pool->plan;
  pl->drops++;
  pl->min_period = min_period;
  pl->state = CP_PLAN_DYING;
  if (pl->live == 0) cp_plan_return_bins_locked(pool);
}

/* A plan dropped for misses before it ever served a whole step had the wrong period (a
 * repeating part of the step, not the step): learning then looks for longer ones. One that
 * served whole steps was right until the loop changed: any period may come next. */
static uint32_t cp_plan_wrong_period(const cp_plan_t *pl) { return pl->whole_steps == 0 ? pl->count : 0; }

static void cp_plan_lose_locked(cp_pool_t *pool) {
  cp_plan_t *pl = &pool->plan;
  pl->state = CP_PLAN_LOST;
  pl->extra = 0;
  if (++pl->losses >= CP_PLAN_MAX_LOSSES) cp_plan_drop_locked(pool, cp_plan_wrong_period(pl));
}

bool cp_plan_give_up_locked(cp_pool_t *pool) {
  cp_plan_t *pl = &pool->plan;
  if (pl->bins == NULL || pl->state == CP_PLAN_ADOPTING) return false; /* its adoption ends first */
  if (pl->state != CP_PLAN_DYING) cp_plan_drop_locked(pool, pl->min_period);
  return pl->bins == NULL;
}

void cp_plan_release_locked(cp_pool_t *pool, cp_block_t *node) {
  cp_plan_t *pl = &pool->plan;
  const cp_plan_entry_t *e =
      (const cp_plan_entry_t *)(const void *)((const char *)node - offsetof(cp_plan_entry_t, node));
  node->state = CP_BLOCK_FREE;
  pl->live--;
  pl->live_bytes -= node->size;
  if (!e->wraps) pl->live_nonwrap--;
  if (pl->state == CP_PLAN_DYING && pl->live == 0) cp_plan_return_bins_locked(pool);
}

static void cp_plan_collect(cp_block_t *b, void *arg) {
  cp_block_t ***at = arg;
  *(*at)++ = b;
}

/* A bin: [offset, offset + size) of the free block `block`; the last one of a plan's bins is
 * the overflow (block NULL until the ladder gives it). */
typedef struct cp_plan_bin_s {
  cp_block_t *block;
  size_t offset, size;
} cp_plan_bin_t;

/* Bytes of the handles wholly inside [lo, hi) of page-mapped segment `seg`: what a stitch may
 * map again elsewhere (a handle is mapped whole). */
static size_t cp_plan_whole_handles(const cp_segment_t *seg, uintptr_t lo, uintptr_t hi) {
  if (!seg->paged || seg->chunk == 0 || lo >= hi) return 0;
  const uintptr_t first = cp_expand_edge_up(seg, lo);
  if (first >= hi) return 0;
  const uintptr_t last = cp_expand_edge_down(seg, hi);
  return last > first ? (size_t)(last - first) : 0;
}

/* The bins of the free block `f`: the whole block, or (`pieces`) only what stitching cannot
 * take: the free ends of handles in part use before the first handle edge inside `f` and
 * after the last, the whole handles between left to the overflow's stitch (a block with no
 * whole handle is one bin). */
static uint32_t cp_plan_bins_of(const cp_block_t *f, bool pieces, cp_plan_bin_t *out) {
  const cp_segment_t *seg = f->segment;
  const uintptr_t lo = f->addr, hi = f->addr + f->size;
  if (!pieces || cp_plan_whole_handles(seg, lo, hi) == 0) {
    out[0] = (cp_plan_bin_t){NULL, 0, f->size};
    return 1;
  }
  const uintptr_t first = cp_expand_edge_up(seg, lo), last = cp_expand_edge_down(seg, hi);
  uint32_t n = 0;
  if (first > lo) out[n++] = (cp_plan_bin_t){NULL, 0, first - lo};
  if (hi > last) out[n++] = (cp_plan_bin_t){NULL, last - lo, hi - last};
  return n;
}

/* A layout of the plan in the free blocks as they are: the bins, their tops once placed (the
 * last bin is the overflow, unbounded), and the new memory the overflow would need. */
typedef struct cp_plan_layout_s {
  cp_plan_bin_t *bins;
  uint32_t *bin_block; /* the free block each bin is of */
  size_t *sizes, *tops;
  uint32_t nb; /* bins, the overflow not counted */
  size_t growth;
} cp_plan_layout_t;

/* Place the plan's arcs in the bins of `free_blocks` (whole blocks, or `pieces`), then count
 * the free whole handles the bins leave: the overflow is stitched from those, and what they
 * lack is growth. False: no host memory. */
static bool cp_plan_lay_out(cp_pool_t *pool, cp_block_t *const *free_blocks, uint32_t nfree, bool pieces,
                            cp_plan_layout_t *lay) {
  cp_plan_t *pl = &pool->plan;
  uint32_t nb = 0;
  for (uint32_t f = 0; f < nfree; f++) {
    const uint32_t k = cp_plan_bins_of(free_blocks[f], pieces, lay->bins + nb);
    for (uint32_t i = 0; i < k; i++) lay->bin_block[nb + i] = f;
    nb += k;
  }
  for (uint32_t b = 0; b < nb; b++) lay->sizes[b] = lay->bins[b].size;
  lay->sizes[nb] = SIZE_MAX;
  lay->bins[nb] = (cp_plan_bin_t){NULL, 0, 0};
  lay->nb = nb;
  const uint64_t t0 = cp_plan_now_ns();
  const bool ok = cp_plan_place(pl->arcs, pl->arc_count, pl->period, pl->entries, lay->sizes, lay->tops, nb + 1);
  pl->plan_ns += cp_plan_now_ns() - t0;
  if (!ok) return false;
  size_t stitchable = 0;
  for (uint32_t b = 0, f = 0; f < nfree; f++) { /* each block less the bins' used parts */
    const cp_block_t *blk = free_blocks[f];
    uintptr_t at = blk->addr;
    for (; b < nb && lay->bin_block[b] == f; b++) {
      const uintptr_t used_lo = blk->addr + lay->bins[b].offset, used_hi = used_lo + lay->tops[b];
      if (lay->tops[b] == 0) continue;
      stitchable += cp_plan_whole_handles(blk->segment, at, used_lo);
      at = used_hi;
    }
    stitchable += cp_plan_whole_handles(blk->segment, at, blk->addr + blk->size);
  }
  const size_t over = lay->tops[nb] != 0 ? cp_size_round(&pool->cfg, lay->tops[nb]) : 0;
  lay->growth = over > stitchable ? over - stitchable : 0;
  return true;
}

/* Take [offset, offset + bytes) of the FREE block `f` (out of the index; spare nodes reserved)
 * as a bin: the block returned, LIVE and the plan's; the rest of `f` below and above stays
 * FREE, indexed. */
static cp_block_t *cp_plan_carve_locked(cp_pool_t *pool, cp_block_t *f, size_t offset, size_t bytes) {
  cp_block_t *b = f;
  if (offset > 0) b = cp_block_cut_locked(pool, f, offset); /* f keeps the part below */
  if (bytes < b->size) cp_free_insert_locked(pool, cp_block_cut_locked(pool, b, bytes));
  if (b != f) cp_free_insert_locked(pool, f);
  b->state = CP_BLOCK_LIVE;
  b->requested = 0;
  b->plan_seq = 0;
  b->plan = CP_PLAN_RANGE;
  return b;
}

static int cp_plan_take_locked(cp_pool_t *pool, uint32_t j, size_t size, void **out_ptr);

/* No room for the plan at this position 0: the pieces taken go back as they were (merged
 * again); tried again at the next steps' starts, a few times, before learning again. */
static void cp_plan_not_now_locked(cp_pool_t *pool) {
  cp_plan_t *pl = &pool->plan;
  for (uint32_t i = 0; pl->bins != NULL && i < pl->bin_count; i++) {
    pl->bins[i]->plan = 0;
    cp_plan_return_block_locked(pool, pl->bins[i]);
  }
  free(pl->bins);
  pl->bins = NULL;
  pl->bin_count = 0;
  pl->range_bytes = 0;
  pl->state = CP_PLAN_ARMED;
  if (++pl->adopt_tries >= CP_PLAN_MAX_LOSSES) {
    pl->min_period = pl->count;
    cp_plan_relearn_locked(pl);
  }
}

/* The planned entry's node, at its offset in its bin `block`. */
static void cp_plan_node_at(cp_plan_entry_t *e, const cp_block_t *block) {
  e->node.addr = block->addr + e->offset;
  e->node.size = e->size;
  e->node.segment = block->segment;
  e->node.plan = CP_PLAN_NODE;
  e->node.state = CP_BLOCK_FREE;
}

/* The plan in service from position 0, which it serves. */
static int cp_plan_serve_from_locked(cp_pool_t *pool, size_t size, void **out_ptr) {
  cp_plan_t *pl = &pool->plan;
  pl->live = pl->live_nonwrap = pl->live_bytes = 0;
  pl->losses = 0;
  pl->extra = 0;
  pl->whole_steps = 0;
  pl->plans++;
  pl->state = CP_PLAN_SERVING;
  return cp_plan_take_locked(pool, 0, size, out_ptr);
}

/* At position 0: place the planned entries in the free memory of the step's stream as it is
 * now, and take the pieces used out of the pool as the plan's bins (cut to what the plan
 * uses). First the free blocks as they are: a plan they hold whole needs no device call.
 * Else also the layout that fills only the free pieces stitching cannot use (the free ends of
 * handles in part use) and leaves the whole free handles to one overflow range, which the
 * pool's ladder stitches from them; the one that needs no new memory wins (the smaller
 * overflow, fewer handles to map, if both). The plan never makes the pool grow: when both
 * would, it waits for a later step's start. CP_OK (position 0 served), CP_PLAN_PASS, or
 * CP_PLAN_OVERFLOW: the pool takes pl->overflow_bytes from its ladder and hands the block to
 * cp_plan_adopt_finish_locked. */
static int cp_plan_adopt_locked(cp_pool_t *pool, size_t size, void **out_ptr) {
  cp_plan_t *pl = &pool->plan;
  cp_stream_t main_stream = 0;
  for (uint32_t j = 0; j < pl->count; j++) {
    if (pl->entries[j].planned) {
      main_stream = pl->entries[j].stream;
      break;
    }
  }
  cp_stream_state_t *st = cp_streams_get_locked(&pool->streams, main_stream);
  if (st == NULL || st->paused) {
    cp_plan_not_now_locked(pool);
    return CP_PLAN_PASS;
  }
  cp_index_t *ix = &st->index[CP_KIND_LARGE];
  const uint32_t nfree = (uint32_t)ix->count, cap = 2 * nfree + 1;
  cp_block_t **free_blocks = malloc((nfree > 0 ? nfree : 1) * sizeof *free_blocks);
  cp_plan_layout_t lay = {malloc(cap * sizeof *lay.bins),
                          malloc(cap * sizeof *lay.bin_block),
                          malloc(cap * sizeof *lay.sizes),
                          malloc(cap * sizeof *lay.tops),
                          0,
                          0};
  uint32_t *taken = malloc(cap * sizeof *taken); /* bin -> its number in pl->bins */
  const size_t *tops = lay.tops;
  bool ok = free_blocks != NULL && lay.bins != NULL && lay.bin_block != NULL && lay.sizes != NULL && lay.tops != NULL &&
            taken != NULL;
  if (ok) {
    cp_block_t **at = free_blocks;
    cp_index_each(ix, cp_plan_collect, &at);
    qsort(free_blocks, nfree, sizeof *free_blocks, cp_block_ptr_by_addr);
    /* The layouts in the order of the function's comment. */
    ok = cp_plan_lay_out(pool, free_blocks, nfree, false, &lay);
    if (ok && tops[lay.nb] != 0) {
      const bool whole_fits = lay.growth == 0;
      const size_t whole_over = tops[lay.nb];
      ok = cp_plan_lay_out(pool, free_blocks, nfree, true, &lay);
      const bool pieces_win = ok && lay.growth == 0 && (!whole_fits || tops[lay.nb] <= whole_over);
      if (!pieces_win) ok = whole_fits && cp_plan_lay_out(pool, free_blocks, nfree, false, &lay);
    }
  }
  const uint32_t nb = lay.nb;
  uint32_t used = 0;
  if (ok) {
    for (uint32_t b = 0; b < nb; b++) used += tops[b] != 0;
    pl->bins = malloc((used + 1) * sizeof *pl->bins); /* + the overflow */
    ok = pl->bins != NULL && cp_reserve_metadata_locked(pool, 2 * (int)used + 2) == CP_OK;
  }
  pl->bin_count = 0;
  pl->range_bytes = 0;
  const size_t granule = pool->cfg.granule;
  /* Carve the pieces used, the higher piece of a block first (the lower one keeps `f`). */
  for (uint32_t b = nb; ok && b-- > 0;) {
    if (tops[b] == 0) continue;
    cp_block_t *f = free_blocks[lay.bin_block[b]];
    if (b + 1 == nb || lay.bin_block[b + 1] != lay.bin_block[b] || tops[b + 1] == 0) cp_free_remove_locked(pool, f);
    const size_t bytes = (tops[b] + granule - 1) / granule * granule;
    cp_block_t *blk = cp_plan_carve_locked(pool, f, lay.bins[b].offset, bytes);
    /* A lower piece of the same block still to carve: `f` (below) went back to the index. */
    if (b > 0 && lay.bin_block[b - 1] == lay.bin_block[b] && tops[b - 1] != 0 && blk != f)
      cp_free_remove_locked(pool, f);
    taken[b] = pl->bin_count;
    pl->bins[pl->bin_count++] = blk;
    pl->range_bytes += blk->size;
  }
  if (ok) {
    for (uint32_t j = 0; j < pl->count; j++) {
      cp_plan_entry_t *e = &pl->entries[j];
      free(e->node.uses);
      memset(&e->node, 0, sizeof e->node);
      if (!e->planned) continue;
      if (e->bin == nb) {
        e->bin = CP_PLAN_OVERFLOW_BIN; /* its node once the ladder gives the overflow */
      } else {
        e->bin = taken[e->bin];
        cp_plan_node_at(e, pl->bins[e->bin]);
      }
    }
  }
  const size_t overflow = ok ? tops[nb] : 0;
  free(free_blocks);
  free(lay.bins);
  free(lay.bin_block);
  free(lay.sizes);
  free(lay.tops);
  free(taken);
  if (!ok) {
    cp_plan_not_now_locked(pool);
    return CP_PLAN_PASS;
  }
  if (overflow == 0) return cp_plan_serve_from_locked(pool, size, out_ptr);
  /* The overflow comes from the ladder, which may let go of the lock: the plan is out of
   * service meanwhile, and the allocation figures are kept to take the block out of them. */
  for (int f = 0; f < CP_PLAN_FAMILIES; f++)
    memcpy(pl->saved[f], pool->stats.family[cp_plan_alloc_families[f]], sizeof pl->saved[f]);
  pl->saved_oversize = pool->stats.oversize_allocations;
  pl->overflow_bytes = cp_size_round(&pool->cfg, overflow);
  pl->overflow_stream = main_stream;
  pl->state = CP_PLAN_ADOPTING;
  return CP_PLAN_OVERFLOW;
}

int cp_plan_adopt_finish_locked(cp_pool_t *pool, cp_block_t *over, size_t size, void **out_ptr) {
  cp_plan_t *pl = &pool->plan;
  if (over == NULL) {
    cp_plan_not_now_locked(pool);
    return CP_PLAN_PASS;
  }
  /* The block is the plan's, not an allocation: none of its figures may stay in the
   * allocation stats, their peaks included. */
  cp_ptrmap_remove(&pool->live, over->addr);
  const int64_t amount[CP_PLAN_FAMILIES] = {1, (int64_t)over->size, 1, (int64_t)over->size, (int64_t)over->requested};
  for (int f = 0; f < CP_PLAN_FAMILIES; f++) {
    for (int kind = 0; kind < CP_KIND_COUNT; kind++) {
      if (kind != CP_KIND_ALL && kind != over->segment->kind) continue;
      cp_stat_t *x = &pool->stats.family[cp_plan_alloc_families[f]][kind];
      x->current -= amount[f];
      x->allocated -= amount[f];
      x->peak = pl->saved[f][kind].peak > x->current ? pl->saved[f][kind].peak : x->current;
    }
  }
  if (over->size >= pool->cfg.max_split_size) pool->stats.oversize_allocations = pl->saved_oversize;
  over->requested = 0;
  over->plan = CP_PLAN_RANGE;
  over->plan_seq = 0;
  const uint32_t number = pl->bin_count++;
  pl->bins[number] = over;
  pl->range_bytes += over->size;
  for (uint32_t j = 0; j < pl->count; j++) {
    cp_plan_entry_t *e = &pl->entries[j];
    if (e->planned && e->bin == CP_PLAN_OVERFLOW_BIN) {
      e->bin = number;
      cp_plan_node_at(e, over);
    }
  }
  return cp_plan_serve_from_locked(pool, size, out_ptr);
}

/* Whether the entries due free by position j are: one still in use (freed late, or waiting
 * for another stream's events) may share bytes with what comes next, and loses the plan. */
static inline bool cp_plan_due_done_locked(cp_pool_t *pool, uint32_t j) {
  cp_plan_t *pl = &pool->plan;
  const cp_plan_entry_t *e = &pl->entries[j];
  for (uint32_t k = 0; k < e->due_count; k++) {
    if (pl->entries[pl->due[e->due_first + k]].node.state != CP_BLOCK_FREE) {
      pl->missed++;
      cp_plan_lose_locked(pool);
      return false;
    }
  }
  return true;
}

/* Serve position j: the due entries first (one still in use loses the plan). CP_OK, or
 * CP_PLAN_PASS for the pool. */
static int cp_plan_take_locked(cp_pool_t *pool, uint32_t j, size_t size, void **out_ptr) {
  cp_plan_t *pl = &pool->plan;
  cp_plan_entry_t *e = &pl->entries[j];
  if (!cp_plan_due_done_locked(pool, j)) return CP_PLAN_PASS;
  pl->pos = j + 1 == pl->count ? 0 : j + 1;
  if (pl->pos == 0) { /* a step served whole */
    pl->losses = 0;
    pl->extra = 0;
    pl->whole_steps++;
  }
  if (!e->planned) return CP_PLAN_PASS;
  cp_block_t *b = &e->node;
  if (CP_UNLIKELY(b->state != CP_BLOCK_FREE) || cp_reserve_metadata_locked(pool, 1) != CP_OK) {
    pl->missed++;
    cp_plan_lose_locked(pool);
    return CP_PLAN_PASS;
  }
  cp_block_make_live_inline(pool, b, size);
  pl->live++;
  pl->live_bytes += b->size;
  if (!e->wraps) pl->live_nonwrap++;
  pl->served++;
  *out_ptr = (void *)b->addr;
  return CP_OK;
}

static inline bool cp_plan_matches(const cp_plan_entry_t *e, size_t rounded, cp_stream_t stream) {
  return e->size == rounded && e->stream == stream;
}

int cp_plan_alloc_locked(cp_pool_t *pool, size_t rounded, size_t size, cp_stream_t stream, void **out_ptr,
                         uint64_t *out_watch) {
  cp_plan_t *pl = &pool->plan;
  *out_watch = 0;
  switch (pl->state) {
    case CP_PLAN_SERVING: {
      const uint32_t j = pl->pos;
      if (cp_plan_matches(&pl->entries[j], rounded, stream)) return cp_plan_take_locked(pool, j, size, out_ptr);
      const uint32_t next = j + 1 == pl->count ? 0 : j + 1;
      if (next != j && cp_plan_matches(&pl->entries[next], rounded, stream)) {
        /* Position j did not come this step: nothing of it is in use; its due entries are
         * checked with the next one's. */
        if (!cp_plan_due_done_locked(pool, j)) return CP_PLAN_PASS;
        return cp_plan_take_locked(pool, next, size, out_ptr);
      }
      pl->missed++;
      if (++pl->extra > CP_PLAN_MAX_EXTRA) cp_plan_lose_locked(pool);
      return CP_PLAN_PASS;
    }
    case CP_PLAN_LOST:
      if (pl->live_nonwrap == 0 && cp_plan_matches(&pl->entries[0], rounded, stream)) {
        pl->state = CP_PLAN_SERVING;
        pl->extra = 0;
        return cp_plan_take_locked(pool, 0, size, out_ptr);
      }
      pl->missed++;
      if (++pl->extra >= pl->count) { /* a step's worth without finding its start: a loss */
        pl->extra = 0;
        if (++pl->losses >= CP_PLAN_MAX_LOSSES) cp_plan_drop_locked(pool, cp_plan_wrong_period(pl));
      }
      return CP_PLAN_PASS;
    case CP_PLAN_LEARNING: {
      if (!cp_plan_learn_room(pl)) return CP_PLAN_PASS;
      const uint64_t number = pl->seq++;
      const uint32_t p = cp_plan_learn_alloc(pl, rounded, stream);
      *out_watch = number + 1;
      if (p != 0) cp_plan_make_locked(pool, p);
      return CP_PLAN_PASS;
    }
    case CP_PLAN_ARMED: {
      const uint64_t number = pl->seq++;
      const uint32_t j = (uint32_t)((number - pl->armed_at) % pl->count);
      if (!cp_plan_matches(&pl->entries[j], rounded, stream)) {
        cp_plan_relearn_locked(pl); /* the loop changed before the plan began */
        return CP_PLAN_PASS;
      }
      if (j != 0) return CP_PLAN_PASS;
      return cp_plan_adopt_locked(pool, size, out_ptr);
    }
    case CP_PLAN_PLANNING:
    case CP_PLAN_ADOPTING: pl->seq++; return CP_PLAN_PASS; /* still counted: the plan arms on numbers */
    default: return CP_PLAN_PASS;                          /* dropped */
  }
}

void cp_plan_init(cp_pool_t *pool) {
  memset(&pool->plan, 0, sizeof pool->plan);
  pool->plan.state = pool->cfg.plan_steps && pool->stitch ? CP_PLAN_LEARNING : CP_PLAN_OFF;
}

void cp_plan_destroy(cp_pool_t *pool) {
  cp_plan_t *pl = &pool->plan;
  cp_plan_learn_free(pl);
  cp_plan_free_arrays(pl);
  free(pl->entries);
  free(pl->due);
  free(pl->arcs);
  free(pl->bins);
  memset(pl, 0, sizeof *pl);
}
