/* check.c — the invariant checker: walks the whole pool and counts what is wrong.
 * Owns: the equations of core/types.h, stream.h and state.h, recomputed from the blocks themselves. */
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

size_t cp_check_locked(cp_pool_t *pool, FILE *out) {
  size_t v = 0;
  const cp_config_t *cfg = &pool->cfg;
  cp_tally_t t[CP_KIND_COUNT] = {{0}};
  size_t pending_blocks = 0, pending_bytes = 0, pending_events = 0, oversize_live = 0, oversize_segs = 0;
  size_t nseg = 0, npaged = 0, space = 0, lent_bytes = 0, draining_bytes = 0, paused_total = 0;

  /* Segments are tiled exactly by their blocks. */
  for (cp_segment_t *seg = pool->segments; seg != NULL; seg = seg->next) {
    nseg++;
    int k = seg->kind;
    if (k != CP_KIND_SMALL && k != CP_KIND_LARGE) {
      CP_VIOLATION("segment %#lx: bad kind %d", (unsigned long)seg->addr, k);
      continue;
    }
    if (seg->next != NULL && seg->next->prev != seg)
      CP_VIOLATION("segment list: broken back link at %#lx", (unsigned long)seg->addr);
    if (seg->paged) {
      npaged++;
      space += seg->size;
      t[k].reserved += (int64_t)(seg->mapped - seg->paused);
      size_t spans = 0;
      for (size_t i = 0; i < seg->span_count; i++) spans += seg->spans[i].size;
      if (spans != seg->paused || seg->paused > seg->mapped || (seg->paused != 0 && !seg->stream->paused))
        CP_VIOLATION("segment %#lx: %zu bytes paused in %zu stretches of %zu bytes (%zu mapped, stream %s)",
                     (unsigned long)seg->addr, seg->paused, seg->span_count, spans, seg->mapped,
                     seg->stream->paused ? "paused" : "not paused");
      paused_total += seg->paused;
      if (seg->chunk == 0 || seg->size % seg->chunk != 0 || seg->size < 2 * seg->chunk)
        CP_VIOLATION("segment %#lx: %zu bytes are not whole chunks of %zu", (unsigned long)seg->addr, seg->size,
                     seg->chunk);
    } else {
      t[k].segments++;
      t[k].reserved += (int64_t)seg->size;
      if (seg->size >= cfg->max_split_size) oversize_segs++;
      if (seg->mapped != 0 || seg->chunk != 0)
        CP_VIOLATION("segment %#lx: plain but has mapped bytes or a chunk", (unsigned long)seg->addr);
    }
    if (seg->head == NULL || seg->head->addr != seg->addr || seg->head->prev != NULL) {
      CP_VIOLATION("segment %#lx: head block does not start it", (unsigned long)seg->addr);
      continue;
    }
    /* The backend gives 512-aligned segments; blocks start at multiples of the granule in
     * them, so a granule below 512 (256 is allowed) gives blocks that are only that aligned. */
    const size_t block_align = cfg->granule < 512 ? cfg->granule : 512;
    if (seg->addr % 512 != 0) CP_VIOLATION("segment %#lx: not 512-aligned", (unsigned long)seg->addr);
    uintptr_t expect_addr = seg->addr;
    size_t blocks = 0, mapped = 0;
    const cp_block_t *tail = NULL;
    for (cp_block_t *b = seg->head; b != NULL; b = b->next) {
      if (++blocks > seg->size / cfg->granule + 1) {
        CP_VIOLATION("segment %#lx: block list does not end", (unsigned long)seg->addr);
        break;
      }
      if (b->segment != seg) CP_VIOLATION("block %#lx: wrong segment", (unsigned long)b->addr);
      if (b->addr != expect_addr)
        CP_VIOLATION("block %#lx: expected at %#lx (gap or overlap)", (unsigned long)b->addr,
                     (unsigned long)expect_addr);
      if (b->size == 0 || b->size % cfg->granule != 0)
        CP_VIOLATION("block %#lx: size %zu is not a positive multiple of the granule", (unsigned long)b->addr, b->size);
      if (b->addr % block_align != 0) CP_VIOLATION("block %#lx: not %zu-aligned", (unsigned long)b->addr, block_align);
      if (b->next != NULL && b->next->prev != b) CP_VIOLATION("block %#lx: broken back link", (unsigned long)b->addr);
      expect_addr = b->addr + b->size;
      tail = b;
      if (b->state >= CP_BLOCK_UNMAPPED && b->state <= CP_BLOCK_UNMAPPING) {
        if (!seg->paged) {
          CP_VIOLATION("block %#lx: state %d in a plain segment", (unsigned long)b->addr, b->state);
        } else if (seg->chunk != 0 && ((b->addr - seg->addr) % seg->chunk != 0 || b->size % seg->chunk != 0)) {
          CP_VIOLATION("block %#lx: (un)mapped range of %zu bytes is not whole chunks", (unsigned long)b->addr,
                       b->size);
        }
        if (cp_index_contains(&seg->stream->index[k], b))
          CP_VIOLATION("block %#lx: unmapped or changing mapping but in the index", (unsigned long)b->addr);
        if (cp_ptrmap_get(&pool->live, b->addr) == b)
          CP_VIOLATION("block %#lx: unmapped or changing mapping but in the live map", (unsigned long)b->addr);
        if (b->state == CP_BLOCK_UNMAPPED && b->next != NULL && b->next->state == CP_BLOCK_UNMAPPED)
          CP_VIOLATION("block %#lx: two unmapped neighbours not merged", (unsigned long)b->addr);
        continue;
      }
      mapped += b->size;
      switch (b->state) {
        case CP_BLOCK_FREE:
          t[k].free_blocks++;
          if (b->next != NULL && b->next->state == CP_BLOCK_FREE)
            CP_VIOLATION("block %#lx: two free neighbours not merged", (unsigned long)b->addr);
          if (!cp_index_contains(&seg->stream->index[k], b))
            CP_VIOLATION("block %#lx: free but not in its stream's index", (unsigned long)b->addr);
          if (cp_ptrmap_get(&pool->live, b->addr) == b)
            CP_VIOLATION("block %#lx: free but in the live map", (unsigned long)b->addr);
          if (cp_block_is_split(b)) {
            t[k].inactive_split++;
            t[k].inactive_split_bytes += (int64_t)b->size;
          }
          break;
        case CP_BLOCK_LIVE:
          t[k].live++;
          t[k].live_bytes += (int64_t)b->size;
          t[k].active++;
          t[k].active_bytes += (int64_t)b->size;
          t[k].requested += (int64_t)b->requested;
          if (b->size >= cfg->max_split_size) oversize_live++;
          if (b->requested == 0 || b->requested > b->size)
            CP_VIOLATION("block %#lx: requested %zu does not fit size %zu", (unsigned long)b->addr, b->requested,
                         b->size);
          if (cp_ptrmap_get(&pool->live, b->addr) != b)
            CP_VIOLATION("block %#lx: live but not in the live map", (unsigned long)b->addr);
          break;
        case CP_BLOCK_PENDING:
          pending_blocks++;
          pending_bytes += b->size;
          pending_events += b->pending_events;
          t[k].active++;
          t[k].active_bytes += (int64_t)b->size;
          t[k].requested += (int64_t)b->requested;
          if (b->pending_events == 0) CP_VIOLATION("block %#lx: pending with no event", (unsigned long)b->addr);
          if (cp_ptrmap_get(&pool->live, b->addr) == b)
            CP_VIOLATION("block %#lx: pending but in the live map", (unsigned long)b->addr);
          break;
        case CP_BLOCK_DRAINING:
          draining_bytes += b->size;
          if (!seg->paged || (b->addr - seg->addr) % seg->chunk != 0 || b->size % seg->chunk != 0)
            CP_VIOLATION("block %#lx: draining but not whole chunks of a page-mapped segment", (unsigned long)b->addr);
          else if (!cp_expand_handle_edge(seg, b->addr) || !cp_expand_handle_edge(seg, b->addr + b->size))
            CP_VIOLATION("block %#lx: draining but not whole handles", (unsigned long)b->addr);
          /* A stream being reaped without an event (cp_drain_release_now_locked: its work was
           * waited for) holds DRAINING blocks while the lock is dropped for each unmap. */
          if (!seg->stream->draining && !seg->stream->reaping)
            CP_VIOLATION("block %#lx: draining but its stream has no drain event", (unsigned long)b->addr);
          if (cp_index_contains(&seg->stream->index[k], b) || cp_ptrmap_get(&pool->live, b->addr) == b)
            CP_VIOLATION("block %#lx: draining but in the index or the live map", (unsigned long)b->addr);
          break;
        case CP_BLOCK_LENT:
          lent_bytes += b->size;
          if (!seg->paged || !pool->stitch)
            CP_VIOLATION("block %#lx: lent outside a stitching page-mapped segment", (unsigned long)b->addr);
          if (cp_index_contains(&seg->stream->index[k], b) || cp_ptrmap_get(&pool->live, b->addr) == b)
            CP_VIOLATION("block %#lx: lent but in the index or the live map", (unsigned long)b->addr);
          break;
        default: CP_VIOLATION("block %#lx: bad state %d", (unsigned long)b->addr, b->state);
      }
    }
    if (expect_addr != seg->addr + seg->size)
      CP_VIOLATION("segment %#lx: blocks cover %zu of %zu bytes", (unsigned long)seg->addr,
                   (size_t)(expect_addr - seg->addr), seg->size);
    if (seg->paged) {
      if (mapped != seg->mapped)
        CP_VIOLATION("segment %#lx: %zu bytes mapped, its blocks hold %zu", (unsigned long)seg->addr, seg->mapped,
                     mapped);
      if (tail == NULL || tail->state != CP_BLOCK_UNMAPPED || tail->size < seg->chunk)
        CP_VIOLATION("segment %#lx: its last chunk is not unmapped", (unsigned long)seg->addr);
    }
  }
  if (nseg != pool->segment_count) CP_VIOLATION("segments: %zu in the list, count says %zu", nseg, pool->segment_count);
  if (npaged != pool->paged_segments || space != pool->address_space)
    CP_VIOLATION("page-mapped segments: %zu (%zu bytes of address space), counts say %zu (%zu)", npaged, space,
                 pool->paged_segments, pool->address_space);
  if (npaged != 0 && !pool->paged) CP_VIOLATION("page-mapped segments in a pool that is not page-mapped");
  /* Paused regions (pause.c): each state's paused bytes are its segments', and the pool's theirs. */
  size_t states_paused = 0, backups = 0;
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
  if (states_paused != pool->paused_bytes || paused_total != pool->paused_bytes || backups != pool->backup_bytes)
    CP_VIOLATION("paused: the pool counts %zu bytes paused and %zu backed up, its streams %zu and %zu",
                 pool->paused_bytes, pool->backup_bytes, states_paused, backups);

  /* The free-segment list holds exactly the wholly free segments. */
  size_t wholly_free = 0, listed = 0;
  for (cp_segment_t *seg = pool->segments; seg != NULL; seg = seg->next) {
    bool is_free = seg->head != NULL && cp_segment_is_free(seg);
    wholly_free += is_free;
    if (is_free != seg->in_free_list)
      CP_VIOLATION("segment %#lx: %s but %s the free-segment list", (unsigned long)seg->addr,
                   is_free ? "wholly free" : "in use", seg->in_free_list ? "on" : "not on");
  }
  for (cp_segment_t *seg = pool->free_segments_head; seg != NULL && listed <= nseg; seg = seg->free_next) listed++;
  if (listed != wholly_free || pool->free_segment_count != wholly_free)
    CP_VIOLATION("free-segment list: %zu listed, count says %zu, %zu segments are wholly free", listed,
                 pool->free_segment_count, wholly_free);

  /* Index <=> free blocks: each free block is in its index (above), and the indexes hold no
   * more nodes than there are free blocks. */
  size_t index_nodes[CP_KIND_COUNT] = {0};
  for (size_t i = 0; i < pool->streams.count; i++) {
    cp_stream_state_t *st = pool->streams.list[i];
    for (int k = CP_KIND_SMALL; k <= CP_KIND_LARGE; k++) {
      v += cp_index_check(&st->index[k], out);
      index_nodes[k] += st->index[k].count;
    }
  }
  for (int k = CP_KIND_SMALL; k <= CP_KIND_LARGE; k++) {
    if ((int64_t)index_nodes[k] != t[k].free_blocks)
      CP_VIOLATION("index: %zu %s nodes for %lld free blocks", index_nodes[k], cp_pool_kind_names[k],
                   (long long)t[k].free_blocks);
  }

  /* Stitched ranges: their blocks in use hold exactly the LENT bytes, and count as large. */
  size_t s_live = 0, s_live_bytes = 0, s_active = 0, s_active_bytes = 0, s_requested = 0, s_lent = 0;
  v += cp_stitch_check_locked(pool, out, &s_live, &s_live_bytes, &s_active, &s_active_bytes, &s_requested, &s_lent);
  if (s_lent + pool->stitch_inflight != lent_bytes)
    CP_VIOLATION("stitched: blocks in use hold %zu bytes, ranges being stitched %zu, segments lend %zu", s_lent,
                 pool->stitch_inflight, lent_bytes);
  if (pool->stitched != NULL && !pool->stitch) CP_VIOLATION("stitched ranges in a pool that does not stitch");
  /* Stream-ordered release (drain.c): the counts match the blocks, ranges and streams. */
  if (draining_bytes != pool->draining_bytes)
    CP_VIOLATION("draining: blocks hold %zu bytes, the count says %zu", draining_bytes, pool->draining_bytes);
  size_t retired = 0, draining_streams = 0;
  for (const cp_segment_t *s = pool->stitched; s != NULL; s = s->next) {
    retired += s->retired;
    if (s->trim_only && !s->retired)
      CP_VIOLATION("stitched: range %#lx marked trimmed but not retired", (unsigned long)s->addr);
    if (s->retired && (!s->broken || (!s->stream->draining && !s->stream->reaping)))
      CP_VIOLATION("stitched: range %#lx retired but %s", (unsigned long)s->addr,
                   !s->broken ? "still serving" : "its stream has no drain event");
  }
  size_t stream_draining = 0;
  for (size_t i = 0; i < pool->streams.count; i++) {
    draining_streams += pool->streams.list[i]->draining;
    stream_draining += pool->streams.list[i]->draining_bytes;
  }
  if (stream_draining != pool->draining_bytes)
    CP_VIOLATION("draining: the streams count %zu bytes, the pool %zu", stream_draining, pool->draining_bytes);
  if (retired != pool->retired_ranges || draining_streams != pool->draining_streams)
    CP_VIOLATION("draining: %zu retired ranges and %zu draining streams, counts say %zu and %zu", retired,
                 draining_streams, pool->retired_ranges, pool->draining_streams);
  for (const cp_segment_t *s = pool->stitched; s != NULL; s = s->next) {
    const cp_block_t *b = s->head;
    if (b == NULL) continue;
    if (b->state == CP_BLOCK_PENDING) {
      pending_blocks++;
      pending_bytes += b->size;
      pending_events += b->pending_events;
    }
    if (b->state == CP_BLOCK_LIVE && b->size >= cfg->max_split_size) oversize_live++;
  }
  t[CP_KIND_LARGE].live += (int64_t)s_live;
  t[CP_KIND_LARGE].live_bytes += (int64_t)s_live_bytes;
  t[CP_KIND_LARGE].active += (int64_t)s_active;
  t[CP_KIND_LARGE].active_bytes += (int64_t)s_active_bytes;
  t[CP_KIND_LARGE].requested += (int64_t)s_requested;

  /* Live map <=> live blocks. */
  size_t live_total = (size_t)(t[CP_KIND_SMALL].live + t[CP_KIND_LARGE].live);
  if (pool->live.count != live_total)
    CP_VIOLATION("live map: %zu entries for %zu live blocks", pool->live.count, live_total);

  /* Stream ordering: queued events <=> pending blocks. */
  size_t queued = 0;
  for (size_t i = 0; i < pool->streams.count; i++) queued += pool->streams.list[i]->queue_len;
  if (queued != pool->streams.pending_entries)
    CP_VIOLATION("streams: %zu queued events, count says %zu", queued, pool->streams.pending_entries);
  if (queued + pool->streams.detached_entries != pending_events)
    CP_VIOLATION("streams: %zu events queued or being waited for, pending blocks wait for %zu",
                 queued + pool->streams.detached_entries, pending_events);
  if (pending_blocks != pool->streams.pending_blocks || pending_bytes != pool->streams.pending_bytes)
    CP_VIOLATION("streams: %zu pending blocks (%zu bytes), counts say %zu (%zu)", pending_blocks, pending_bytes,
                 pool->streams.pending_blocks, pool->streams.pending_bytes);

  /* Stats <=> blocks. */
  for (int k = CP_KIND_ALL; k <= CP_KIND_LARGE; k++) {
    cp_tally_t e = t[k];
    if (k == CP_KIND_ALL) {
      cp_tally_t *s = &t[CP_KIND_SMALL], *l = &t[CP_KIND_LARGE];
      e = (cp_tally_t){s->segments + l->segments,
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
  if (pool->stats.oversize_allocations.current != (int64_t)oversize_live)
    CP_VIOLATION("stats: oversize_allocations.current %lld, blocks say %zu",
                 (long long)pool->stats.oversize_allocations.current, oversize_live);
  if (pool->stats.oversize_segments.current != (int64_t)oversize_segs)
    CP_VIOLATION("stats: oversize_segments.current %lld, segments say %zu",
                 (long long)pool->stats.oversize_segments.current, oversize_segs);
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
