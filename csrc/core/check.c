/* check.c — the invariant checker: walks the whole pool and counts what is wrong.
 * Owns: the equations of core/types.h, stream.h and state.h, recomputed from the blocks themselves:
 * one function per structure (a segment, its blocks, the segment lists, paused regions, the free
 * index, stitched ranges, draining memory, the live map and streams, the stats), each adding what
 * it counts to one cp_walk_t that the later ones compare with the pool's counts. */
#include <stdlib.h>

#include "core/check.h"
#include "core/expand.h"
#include "core/stitch.h"

#define CP_VIOLATION(...)        \
  do {                           \
    v++;                         \
    if (out != NULL) {           \
      fprintf(out, __VA_ARGS__); \
      fputc('\n', out);          \
    }                            \
  } while (0)

/* Figures recomputed from the blocks, per kind (index CP_KIND_SMALL / CP_KIND_LARGE). */
typedef struct cp_tally_s {
  int64_t segments, reserved;
  int64_t live, live_bytes;
  int64_t active, active_bytes, requested;
  int64_t inactive_split, inactive_split_bytes;
  int64_t free_blocks;
} cp_tally_t;

static size_t cp_check_stat(FILE *out, const char *name, int kind, const cp_stat_t *s, int64_t expect) {
  size_t v = 0;
  if (s->current != expect) {
    CP_VIOLATION("stats: %s.%s.current is %lld but the blocks say %lld", name, cp_pool_kind_names[kind],
                 (long long)s->current, (long long)expect);
  }
  if (s->peak < s->current) {
    CP_VIOLATION("stats: %s.%s.peak %lld is below current %lld", name, cp_pool_kind_names[kind], (long long)s->peak,
                 (long long)s->current);
  }
  return v;
}

/* What the walk counts, for the checks that compare it with the pool's counts. */
typedef struct cp_walk_s {
  cp_tally_t t[CP_KIND_COUNT];
  size_t pending_blocks, pending_bytes, pending_events, oversize_live, oversize_segs;
  size_t nseg, npaged, space, lent_bytes, draining_bytes, paused_total;
} cp_walk_t;

/* A segment's figures: page-mapped (chunks, mapped and paused bytes) or plain. */
static size_t cp_check_segment_figures(const cp_pool_t *pool, const cp_segment_t *seg, cp_walk_t *w, FILE *out) {
  size_t v = 0;
  const int k = seg->kind;
  if (seg->paged) {
    w->npaged++;
    w->space += seg->size;
    w->t[k].reserved += (int64_t)(seg->mapped - seg->paused);
    size_t spans = 0;
    for (size_t i = 0; i < seg->span_count; i++) spans += seg->spans[i].size;
    if (spans != seg->paused || seg->paused > seg->mapped || (seg->paused != 0 && !seg->stream->paused))
      CP_VIOLATION("segment %#lx: %zu bytes paused in %zu stretches of %zu bytes (%zu mapped, stream %s)",
                   (unsigned long)seg->addr, seg->paused, seg->span_count, spans, seg->mapped,
                   seg->stream->paused ? "paused" : "not paused");
    w->paused_total += seg->paused;
    if (seg->chunk == 0 || seg->size % seg->chunk != 0 || seg->size < 2 * seg->chunk)
      CP_VIOLATION("segment %#lx: %zu bytes are not whole chunks of %zu", (unsigned long)seg->addr, seg->size,
                   seg->chunk);
  } else {
    w->t[k].segments++;
    w->t[k].reserved += (int64_t)seg->size;
    if (seg->size >= pool->cfg.max_split_size) w->oversize_segs++;
    if (seg->mapped != 0 || seg->chunk != 0)
      CP_VIOLATION("segment %#lx: plain but has mapped bytes or a chunk", (unsigned long)seg->addr);
  }
  return v;
}

/* A segment's own fields; *out_walk: its blocks can be walked (a known kind, a head at its start). */
static size_t cp_check_segment(const cp_pool_t *pool, const cp_segment_t *seg, cp_walk_t *w, FILE *out,
                               bool *out_walk) {
  size_t v = 0;
  *out_walk = false;
  w->nseg++;
  if (seg->kind != CP_KIND_SMALL && seg->kind != CP_KIND_LARGE) {
    CP_VIOLATION("segment %#lx: bad kind %d", (unsigned long)seg->addr, seg->kind);
    return v;
  }
  if (seg->next != NULL && seg->next->prev != seg)
    CP_VIOLATION("segment list: broken back link at %#lx", (unsigned long)seg->addr);
  v += cp_check_segment_figures(pool, seg, w, out);
  if (seg->head == NULL || seg->head->addr != seg->addr || seg->head->prev != NULL) {
    CP_VIOLATION("segment %#lx: head block does not start it", (unsigned long)seg->addr);
    return v;
  }
  if (seg->addr % 512 != 0) CP_VIOLATION("segment %#lx: not 512-aligned", (unsigned long)seg->addr);
  *out_walk = true;
  return v;
}

/* A block that is unmapped, or whose mapping is changing: in no index and no live map. */
static size_t cp_check_unmapped_block(cp_pool_t *pool, const cp_segment_t *seg, cp_block_t *b, FILE *out) {
  size_t v = 0;
  if (!seg->paged) {
    CP_VIOLATION("block %#lx: state %d in a plain segment", (unsigned long)b->addr, b->state);
  } else if (seg->chunk != 0 && ((b->addr - seg->addr) % seg->chunk != 0 || b->size % seg->chunk != 0)) {
    CP_VIOLATION("block %#lx: (un)mapped range of %zu bytes is not whole chunks", (unsigned long)b->addr, b->size);
  }
  if (cp_index_contains(&seg->stream->index[seg->kind], b))
    CP_VIOLATION("block %#lx: unmapped or changing mapping but in the index", (unsigned long)b->addr);
  if (cp_ptrmap_get(&pool->live, b->addr) == b)
    CP_VIOLATION("block %#lx: unmapped or changing mapping but in the live map", (unsigned long)b->addr);
  if (b->state == CP_BLOCK_UNMAPPED && b->next != NULL && b->next->state == CP_BLOCK_UNMAPPED)
    CP_VIOLATION("block %#lx: two unmapped neighbours not merged", (unsigned long)b->addr);
  return v;
}

/* A FREE block: merged with its free neighbours, in its stream's index, not in the live map. */
static size_t cp_check_free_block(cp_pool_t *pool, const cp_segment_t *seg, cp_block_t *b, cp_walk_t *w, FILE *out) {
  size_t v = 0;
  const int k = seg->kind;
  w->t[k].free_blocks++;
  if (b->next != NULL && b->next->state == CP_BLOCK_FREE)
    CP_VIOLATION("block %#lx: two free neighbours not merged", (unsigned long)b->addr);
  if (!cp_index_contains(&seg->stream->index[k], b))
    CP_VIOLATION("block %#lx: free but not in its stream's index", (unsigned long)b->addr);
  if (cp_ptrmap_get(&pool->live, b->addr) == b)
    CP_VIOLATION("block %#lx: free but in the live map", (unsigned long)b->addr);
  if (cp_block_is_split(b)) {
    w->t[k].inactive_split++;
    w->t[k].inactive_split_bytes += (int64_t)b->size;
  }
  return v;
}

/* A block in use: LIVE (in the live map) or PENDING (on other streams' events, not in it). */
static size_t cp_check_used_block(cp_pool_t *pool, const cp_segment_t *seg, cp_block_t *b, cp_walk_t *w, FILE *out) {
  size_t v = 0;
  if (b->plan == CP_PLAN_RANGE) return v; /* a step plan's range: its nodes count (cp_check_plan) */
  cp_tally_t *t = &w->t[seg->kind];
  t->active++;
  t->active_bytes += (int64_t)b->size;
  t->requested += (int64_t)b->requested;
  if (b->state == CP_BLOCK_LIVE) {
    t->live++;
    t->live_bytes += (int64_t)b->size;
    if (b->size >= pool->cfg.max_split_size) w->oversize_live++;
    if (b->requested == 0 || b->requested > b->size)
      CP_VIOLATION("block %#lx: requested %zu does not fit size %zu", (unsigned long)b->addr, b->requested, b->size);
    if (cp_ptrmap_get(&pool->live, b->addr) != b)
      CP_VIOLATION("block %#lx: live but not in the live map", (unsigned long)b->addr);
    return v;
  }
  w->pending_blocks++;
  w->pending_bytes += b->size;
  w->pending_events += b->pending_events;
  if (b->pending_events == 0) CP_VIOLATION("block %#lx: pending with no event", (unsigned long)b->addr);
  if (cp_ptrmap_get(&pool->live, b->addr) == b)
    CP_VIOLATION("block %#lx: pending but in the live map", (unsigned long)b->addr);
  return v;
}

/* Bytes handed elsewhere: DRAINING (whole handles waiting for their stream's drain event) or
 * LENT (to a stitched range). */
static size_t cp_check_away_block(cp_pool_t *pool, const cp_segment_t *seg, cp_block_t *b, cp_walk_t *w, FILE *out) {
  size_t v = 0;
  const bool listed = cp_index_contains(&seg->stream->index[seg->kind], b) || cp_ptrmap_get(&pool->live, b->addr) == b;
  if (b->state == CP_BLOCK_LENT) {
    w->lent_bytes += b->size;
    if (!seg->paged || !pool->stitch)
      CP_VIOLATION("block %#lx: lent outside a stitching page-mapped segment", (unsigned long)b->addr);
    if (listed) CP_VIOLATION("block %#lx: lent but in the index or the live map", (unsigned long)b->addr);
    return v;
  }
  w->draining_bytes += b->size;
  if (!seg->paged || (b->addr - seg->addr) % seg->chunk != 0 || b->size % seg->chunk != 0)
    CP_VIOLATION("block %#lx: draining but not whole chunks of a page-mapped segment", (unsigned long)b->addr);
  else if (!cp_expand_handle_edge(seg, b->addr) || !cp_expand_handle_edge(seg, b->addr + b->size))
    CP_VIOLATION("block %#lx: draining but not whole handles", (unsigned long)b->addr);
  /* A stream being reaped without an event (cp_drain_release_now_locked: its work was
   * waited for) holds DRAINING blocks while the lock is dropped for each unmap. */
  if (!seg->stream->draining && !seg->stream->reaping)
    CP_VIOLATION("block %#lx: draining but its stream has no drain event", (unsigned long)b->addr);
  if (listed) CP_VIOLATION("block %#lx: draining but in the index or the live map", (unsigned long)b->addr);
  return v;
}

/* Where a block lies: right after the one before it, in its segment, whole granules, aligned. */
static size_t cp_check_block_place(const cp_pool_t *pool, const cp_segment_t *seg, const cp_block_t *b,
                                   uintptr_t expect_addr, FILE *out) {
  size_t v = 0;
  const size_t granule = pool->cfg.granule;
  /* The backend gives 512-aligned segments; blocks start at multiples of the granule in
   * them, so a granule below 512 (256 is allowed) gives blocks that are only that aligned. */
  const size_t block_align = granule < 512 ? granule : 512;
  if (b->segment != seg) CP_VIOLATION("block %#lx: wrong segment", (unsigned long)b->addr);
  if (b->addr != expect_addr)
    CP_VIOLATION("block %#lx: expected at %#lx (gap or overlap)", (unsigned long)b->addr, (unsigned long)expect_addr);
  if (b->size == 0 || b->size % granule != 0)
    CP_VIOLATION("block %#lx: size %zu is not a positive multiple of the granule", (unsigned long)b->addr, b->size);
  if (b->addr % block_align != 0) CP_VIOLATION("block %#lx: not %zu-aligned", (unsigned long)b->addr, block_align);
  if (b->next != NULL && b->next->prev != b) CP_VIOLATION("block %#lx: broken back link", (unsigned long)b->addr);
  return v;
}

/* Segments are tiled exactly by their blocks, each of them in a state its segment allows. */
static size_t cp_check_blocks(cp_pool_t *pool, const cp_segment_t *seg, cp_walk_t *w, FILE *out) {
  size_t v = 0, blocks = 0, mapped = 0;
  uintptr_t expect_addr = seg->addr;
  const cp_block_t *tail = NULL;
  for (cp_block_t *b = seg->head; b != NULL; b = b->next) {
    if (++blocks > seg->size / pool->cfg.granule + 1) {
      CP_VIOLATION("segment %#lx: block list does not end", (unsigned long)seg->addr);
      break;
    }
    v += cp_check_block_place(pool, seg, b, expect_addr, out);
    expect_addr = b->addr + b->size;
    tail = b;
    if (b->state >= CP_BLOCK_UNMAPPED && b->state <= CP_BLOCK_UNMAPPING) {
      v += cp_check_unmapped_block(pool, seg, b, out);
      continue;
    }
    mapped += b->size;
    switch (b->state) {
      case CP_BLOCK_FREE: v += cp_check_free_block(pool, seg, b, w, out); break;
      case CP_BLOCK_LIVE:
      case CP_BLOCK_PENDING: v += cp_check_used_block(pool, seg, b, w, out); break;
      case CP_BLOCK_DRAINING:
      case CP_BLOCK_LENT: v += cp_check_away_block(pool, seg, b, w, out); break;
      default: CP_VIOLATION("block %#lx: bad state %d", (unsigned long)b->addr, b->state);
    }
  }
  if (expect_addr != seg->addr + seg->size)
    CP_VIOLATION("segment %#lx: blocks cover %zu of %zu bytes", (unsigned long)seg->addr,
                 (size_t)(expect_addr - seg->addr), seg->size);
  if (seg->paged && mapped != seg->mapped)
    CP_VIOLATION("segment %#lx: %zu bytes mapped, its blocks hold %zu", (unsigned long)seg->addr, seg->mapped, mapped);
  if (seg->paged && (tail == NULL || tail->state != CP_BLOCK_UNMAPPED || tail->size < seg->chunk))
    CP_VIOLATION("segment %#lx: its last chunk is not unmapped", (unsigned long)seg->addr);
  return v;
}

/* Every segment and its blocks, then the segment counts. */
static size_t cp_check_segments(cp_pool_t *pool, cp_walk_t *w, FILE *out) {
  size_t v = 0;
  for (cp_segment_t *seg = pool->segments; seg != NULL; seg = seg->next) {
    bool walk = false;
    v += cp_check_segment(pool, seg, w, out, &walk);
    if (walk) v += cp_check_blocks(pool, seg, w, out);
  }
  if (w->nseg != pool->segment_count)
    CP_VIOLATION("segments: %zu in the list, count says %zu", w->nseg, pool->segment_count);
  if (w->npaged != pool->paged_segments || w->space != pool->address_space)
    CP_VIOLATION("page-mapped segments: %zu (%zu bytes of address space), counts say %zu (%zu)", w->npaged, w->space,
                 pool->paged_segments, pool->address_space);
  if (w->npaged != 0 && !pool->paged) CP_VIOLATION("page-mapped segments in a pool that is not page-mapped");
  return v;
}

/* Paused regions (pause.c): each state's paused bytes are its segments', and the pool's theirs. */
static size_t cp_check_paused(const cp_pool_t *pool, const cp_walk_t *w, FILE *out) {
  size_t v = 0, states_paused = 0, backups = 0;
  for (size_t i = 0; i < pool->streams.count; i++) {
    const cp_stream_state_t *st = pool->streams.list[i];
    size_t mine = 0, copied = 0;
    for (const cp_segment_t *seg = pool->segments; seg != NULL; seg = seg->next)
      mine += seg->stream == st ? seg->paused : 0;
    for (size_t k = 0; k < st->backup_count; k++) copied += st->backups[k].size;
    if (mine != st->paused_bytes || copied != st->backup_bytes || (st->tag == 0 && st->paused))
      CP_VIOLATION(
          "stream %#lx (region %u): %zu bytes paused and %zu backed up, its segments and backups hold %zu "
          "and %zu",
          (unsigned long)st->handle, (unsigned)st->tag, st->paused_bytes, st->backup_bytes, mine, copied);
    states_paused += st->paused_bytes;
    backups += st->backup_bytes;
  }
  if (states_paused != pool->paused_bytes || w->paused_total != pool->paused_bytes || backups != pool->backup_bytes)
    CP_VIOLATION("paused: the pool counts %zu bytes paused and %zu backed up, its streams %zu and %zu",
                 pool->paused_bytes, pool->backup_bytes, states_paused, backups);
  return v;
}

/* The free-segment list holds exactly the wholly free segments. */
static size_t cp_check_free_segments(const cp_pool_t *pool, const cp_walk_t *w, FILE *out) {
  size_t v = 0, wholly_free = 0, listed = 0;
  for (cp_segment_t *seg = pool->segments; seg != NULL; seg = seg->next) {
    bool is_free = seg->head != NULL && cp_segment_is_free(seg);
    wholly_free += is_free;
    if (is_free != seg->in_free_list)
      CP_VIOLATION("segment %#lx: %s but %s the free-segment list", (unsigned long)seg->addr,
                   is_free ? "wholly free" : "in use", seg->in_free_list ? "on" : "not on");
  }
  for (cp_segment_t *seg = pool->free_segments_head; seg != NULL && listed <= w->nseg; seg = seg->free_next) listed++;
  if (listed != wholly_free || pool->free_segment_count != wholly_free)
    CP_VIOLATION("free-segment list: %zu listed, count says %zu, %zu segments are wholly free", listed,
                 pool->free_segment_count, wholly_free);
  return v;
}

/* Index <=> free blocks: each free block is in its index (cp_check_free_block), and the
 * indexes hold no more nodes than there are free blocks. */
static size_t cp_check_free_index(const cp_pool_t *pool, const cp_walk_t *w, FILE *out) {
  size_t v = 0, index_nodes[CP_KIND_COUNT] = {0};
  for (size_t i = 0; i < pool->streams.count; i++) {
    cp_stream_state_t *st = pool->streams.list[i];
    for (int k = CP_KIND_SMALL; k <= CP_KIND_LARGE; k++) {
      v += cp_index_check(&st->index[k], out);
      index_nodes[k] += st->index[k].count;
    }
  }
  for (int k = CP_KIND_SMALL; k <= CP_KIND_LARGE; k++) {
    if ((int64_t)index_nodes[k] != w->t[k].free_blocks)
      CP_VIOLATION("index: %zu %s nodes for %lld free blocks", index_nodes[k], cp_pool_kind_names[k],
                   (long long)w->t[k].free_blocks);
  }
  return v;
}

/* Stitched ranges: their blocks in use hold exactly the LENT bytes, and count as large. */
static size_t cp_check_stitched(cp_pool_t *pool, cp_walk_t *w, FILE *out) {
  size_t v = 0;
  size_t s_live = 0, s_live_bytes = 0, s_active = 0, s_active_bytes = 0, s_requested = 0, s_lent = 0;
  v += cp_stitch_check_locked(pool, out, &s_live, &s_live_bytes, &s_active, &s_active_bytes, &s_requested, &s_lent);
  if (s_lent + pool->stitch_inflight != w->lent_bytes)
    CP_VIOLATION("stitched: blocks in use hold %zu bytes, ranges being stitched %zu, segments lend %zu", s_lent,
                 pool->stitch_inflight, w->lent_bytes);
  if (pool->stitched != NULL && !pool->stitch) CP_VIOLATION("stitched ranges in a pool that does not stitch");
  for (const cp_segment_t *s = pool->stitched; s != NULL; s = s->next) {
    const cp_block_t *b = s->head;
    if (b == NULL) continue;
    if (b->state == CP_BLOCK_PENDING) {
      w->pending_blocks++;
      w->pending_bytes += b->size;
      w->pending_events += b->pending_events;
    }
    if (b->state == CP_BLOCK_LIVE && b->plan != CP_PLAN_RANGE && b->size >= pool->cfg.max_split_size)
      w->oversize_live++;
  }
  cp_tally_t *large = &w->t[CP_KIND_LARGE];
  large->live += (int64_t)s_live;
  large->live_bytes += (int64_t)s_live_bytes;
  large->active += (int64_t)s_active;
  large->active_bytes += (int64_t)s_active_bytes;
  large->requested += (int64_t)s_requested;
  return v;
}

/* The step plan (Note [Learning the step]): its nodes in use count as blocks in use; its bins
 * are LIVE blocks of segments, out of the live map, held exactly while a plan serves. */
static size_t cp_check_plan(cp_pool_t *pool, cp_walk_t *w, FILE *out) {
  size_t v = 0;
  const cp_plan_t *pl = &pool->plan;
  const bool holds = pl->state == CP_PLAN_SERVING || pl->state == CP_PLAN_LOST || pl->state == CP_PLAN_DYING ||
                     pl->state == CP_PLAN_ADOPTING;
  if ((pl->bins != NULL) != holds)
    CP_VIOLATION("plan: state %s %s bins", cp_plan_state_name(pl->state), pl->bins != NULL ? "holds" : "lacks");
  if (pl->state != CP_PLAN_OFF && (!pool->stitch || !pool->cfg.plan_steps))
    CP_VIOLATION("plan: state %s in a pool that does not plan", cp_plan_state_name(pl->state));
  if (pl->bins == NULL) return v;
  size_t bytes = 0;
  for (uint32_t i = 0; i < pl->bin_count; i++) {
    const cp_block_t *r = pl->bins[i];
    bytes += r->size;
    if (r->plan != CP_PLAN_RANGE || r->state != CP_BLOCK_LIVE || cp_ptrmap_get(&pool->live, r->addr) == r)
      CP_VIOLATION("plan: bin %#lx is not the plan's LIVE block, out of the live map", (unsigned long)r->addr);
  }
  if (bytes != pl->range_bytes) CP_VIOLATION("plan: bins hold %zu bytes, the count says %zu", bytes, pl->range_bytes);
  size_t in_use = 0, nonwrap = 0, in_use_bytes = 0;
  for (uint32_t j = 0; j < pl->count; j++) {
    const cp_plan_entry_t *e = &pl->entries[j];
    const cp_block_t *b = &e->node;
    if (!e->planned) {
      if (b->state != CP_BLOCK_FREE || b->plan != 0) CP_VIOLATION("plan: entry %u is not planned but has a node", j);
      continue;
    }
    if (pl->state == CP_PLAN_ADOPTING && e->bin >= pl->bin_count) { /* its bin, the overflow, is on its way */
      if (b->state != CP_BLOCK_FREE || b->plan != 0) CP_VIOLATION("plan: entry %u in use before its bin", j);
      continue;
    }
    const cp_block_t *r = e->bin < pl->bin_count ? pl->bins[e->bin] : NULL;
    if (r == NULL || b->plan != CP_PLAN_NODE || b->segment != r->segment || b->addr != r->addr + e->offset ||
        b->size != e->size || e->offset + e->size > r->size) {
      CP_VIOLATION("plan: entry %u's node is not at its offset %zu in its bin", j, e->offset);
      continue;
    }
    if (b->state == CP_BLOCK_FREE) {
      if (cp_ptrmap_get(&pool->live, b->addr) == b) CP_VIOLATION("plan: entry %u free but in the live map", j);
      continue;
    }
    in_use++;
    in_use_bytes += b->size;
    if (!e->wraps) nonwrap++;
    if (b->state != CP_BLOCK_LIVE && b->state != CP_BLOCK_PENDING) {
      CP_VIOLATION("plan: entry %u in state %d", j, b->state);
      continue;
    }
    v += cp_check_used_block(pool, r->segment, (cp_block_t *)b, w, out); /* counted as any block in use */
  }
  /* Planned blocks in use never share a byte: their offsets were planned apart. */
  const cp_block_t **used = malloc((in_use > 0 ? in_use : 1) * sizeof *used);
  if (used != NULL) {
    size_t n = 0;
    for (uint32_t j = 0; j < pl->count; j++)
      if (pl->entries[j].planned && pl->entries[j].node.state != CP_BLOCK_FREE) used[n++] = &pl->entries[j].node;
    qsort(used, n, sizeof *used, cp_block_ptr_by_addr);
    for (size_t i = 1; i < n; i++)
      if (used[i - 1]->addr + used[i - 1]->size > used[i]->addr)
        CP_VIOLATION("plan: planned blocks %#lx and %#lx in use overlap", (unsigned long)used[i - 1]->addr,
                     (unsigned long)used[i]->addr);
    free(used);
  }
  if (in_use_bytes != pl->live_bytes)
    CP_VIOLATION("plan: nodes in use hold %zu bytes, the count says %zu", in_use_bytes, pl->live_bytes);
  if (in_use != pl->live || nonwrap != pl->live_nonwrap)
    CP_VIOLATION("plan: %zu nodes in use (%zu not across position 0), counts say %zu (%zu)", in_use, nonwrap, pl->live,
                 pl->live_nonwrap);
  return v;
}

/* Stream-ordered release (drain.c): the counts match the blocks, ranges and streams. */
static size_t cp_check_draining(const cp_pool_t *pool, const cp_walk_t *w, FILE *out) {
  size_t v = 0, retired = 0, draining_streams = 0, stream_draining = 0;
  if (w->draining_bytes != pool->draining_bytes)
    CP_VIOLATION("draining: blocks hold %zu bytes, the count says %zu", w->draining_bytes, pool->draining_bytes);
  for (const cp_segment_t *s = pool->stitched; s != NULL; s = s->next) {
    retired += s->retired;
    if (s->trim_only && !s->retired)
      CP_VIOLATION("stitched: range %#lx marked trimmed but not retired", (unsigned long)s->addr);
    if (s->retired && (!s->broken || (!s->stream->draining && !s->stream->reaping)))
      CP_VIOLATION("stitched: range %#lx retired but %s", (unsigned long)s->addr,
                   !s->broken ? "still serving" : "its stream has no drain event");
  }
  for (size_t i = 0; i < pool->streams.count; i++) {
    draining_streams += pool->streams.list[i]->draining;
    stream_draining += pool->streams.list[i]->draining_bytes;
  }
  if (stream_draining != pool->draining_bytes)
    CP_VIOLATION("draining: the streams count %zu bytes, the pool %zu", stream_draining, pool->draining_bytes);
  if (retired != pool->retired_ranges || draining_streams != pool->draining_streams)
    CP_VIOLATION("draining: %zu retired ranges and %zu draining streams, counts say %zu and %zu", retired,
                 draining_streams, pool->retired_ranges, pool->draining_streams);
  return v;
}

/* Live map <=> live blocks; stream ordering: queued events <=> pending blocks. */
static size_t cp_check_streams(const cp_pool_t *pool, const cp_walk_t *w, FILE *out) {
  size_t v = 0, queued = 0;
  const size_t live_total = (size_t)(w->t[CP_KIND_SMALL].live + w->t[CP_KIND_LARGE].live);
  if (pool->live.count != live_total)
    CP_VIOLATION("live map: %zu entries for %zu live blocks", pool->live.count, live_total);
  for (size_t i = 0; i < pool->streams.count; i++) queued += pool->streams.list[i]->queue_len;
  if (queued != pool->streams.pending_entries)
    CP_VIOLATION("streams: %zu queued events, count says %zu", queued, pool->streams.pending_entries);
  if (queued + pool->streams.detached_entries != w->pending_events)
    CP_VIOLATION("streams: %zu events queued or being waited for, pending blocks wait for %zu",
                 queued + pool->streams.detached_entries, w->pending_events);
  if (w->pending_blocks != pool->streams.pending_blocks || w->pending_bytes != pool->streams.pending_bytes)
    CP_VIOLATION("streams: %zu pending blocks (%zu bytes), counts say %zu (%zu)", w->pending_blocks, w->pending_bytes,
                 pool->streams.pending_blocks, pool->streams.pending_bytes);
  return v;
}

/* The figures of kind `k`: CP_KIND_ALL sums the small and large ones. */
static cp_tally_t cp_tally_of(const cp_walk_t *w, int k) {
  if (k != CP_KIND_ALL) return w->t[k];
  const cp_tally_t *s = &w->t[CP_KIND_SMALL], *l = &w->t[CP_KIND_LARGE];
  return (cp_tally_t){s->segments + l->segments,
                      s->reserved + l->reserved,
                      s->live + l->live,
                      s->live_bytes + l->live_bytes,
                      s->active + l->active,
                      s->active_bytes + l->active_bytes,
                      s->requested + l->requested,
                      s->inactive_split + l->inactive_split,
                      s->inactive_split_bytes + l->inactive_split_bytes,
                      s->free_blocks + l->free_blocks};
}

/* Stats <=> blocks. */
static size_t cp_check_stats(const cp_pool_t *pool, const cp_walk_t *w, FILE *out) {
  size_t v = 0;
  for (int k = CP_KIND_ALL; k <= CP_KIND_LARGE; k++) {
    const cp_tally_t e = cp_tally_of(w, k);
    const cp_stat_t *f[CP_STAT_FAMILY_COUNT];
    for (int i = 0; i < CP_STAT_FAMILY_COUNT; i++) f[i] = &pool->stats.family[i][k];
    v += cp_check_stat(out, "segment", k, f[CP_STAT_SEGMENT], e.segments);
    v += cp_check_stat(out, "reserved_bytes", k, f[CP_STAT_RESERVED_BYTES], e.reserved);
    v += cp_check_stat(out, "allocation", k, f[CP_STAT_ALLOCATION], e.live);
    v += cp_check_stat(out, "allocated_bytes", k, f[CP_STAT_ALLOCATED_BYTES], e.live_bytes);
    v += cp_check_stat(out, "active", k, f[CP_STAT_ACTIVE], e.active);
    v += cp_check_stat(out, "active_bytes", k, f[CP_STAT_ACTIVE_BYTES], e.active_bytes);
    v += cp_check_stat(out, "requested_bytes", k, f[CP_STAT_REQUESTED_BYTES], e.requested);
    v += cp_check_stat(out, "inactive_split", k, f[CP_STAT_INACTIVE_SPLIT], e.inactive_split);
    v += cp_check_stat(out, "inactive_split_bytes", k, f[CP_STAT_INACTIVE_SPLIT_BYTES], e.inactive_split_bytes);
  }
  if (pool->stats.oversize_allocations.current != (int64_t)w->oversize_live)
    CP_VIOLATION("stats: oversize_allocations.current %lld, blocks say %zu",
                 (long long)pool->stats.oversize_allocations.current, w->oversize_live);
  if (pool->stats.oversize_segments.current != (int64_t)w->oversize_segs)
    CP_VIOLATION("stats: oversize_segments.current %lld, segments say %zu",
                 (long long)pool->stats.oversize_segments.current, w->oversize_segs);
  return v;
}

/* In this order: each check compares what the earlier ones counted. */
size_t cp_check_locked(cp_pool_t *pool, FILE *out) {
  cp_walk_t w = {0};
  size_t v = cp_check_segments(pool, &w, out);
  v += cp_check_paused(pool, &w, out);
  v += cp_check_free_segments(pool, &w, out);
  v += cp_check_free_index(pool, &w, out);
  v += cp_check_stitched(pool, &w, out);
  v += cp_check_plan(pool, &w, out);
  v += cp_check_draining(pool, &w, out);
  v += cp_check_streams(pool, &w, out);
  v += cp_check_stats(pool, &w, out);
  return v;
}

#ifdef CP_CHECK_EVERY_OP
void cp_check_or_abort_locked(cp_pool_t *pool, const char *where) {
  size_t v = cp_check_locked(pool, NULL);
  if (v != 0) {
    fprintf(stderr, "cudapool: %zu invariant violations after %s:\n", v, where);
    cp_check_locked(pool, stderr);
    abort();
  }
}
#endif
