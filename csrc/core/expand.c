/* expand.c — page-mapped ("expandable") segments: one address range per (stream, kind) that
 * grows in place by mapping chunks of memory at its end, and gives back whole free chunks.
 * Owns: the UNMAPPED, MAPPING and UNMAPPING blocks and every page-mapped backend call. */
#include <stdlib.h>
#include <string.h>

#include "core/expand.h"
#include "core/history.h"
#include "core/sizes.h"
#include "core/snapshot.h"

/* Note [Expandable segments]
 * expandable_segments:True follows the built-in allocator's rules (c10/cuda/
 * CUDACachingAllocator.cpp, Note [Expandable Segments], class ExpandableSegment):
 *  - A (stream, kind) is served by one segment: an address range of (total + total / 8) bytes
 *    of the device, rounded up to whole chunks (ExpandableSegment's constructor, "1 1/8 the
 *    total memory"), with no memory behind it at first. A chunk is what is mapped and unmapped
 *    at a time: small_segment (2 MiB, kSmallBuffer) for the small pool, large_segment
 *    (20 MiB, kLargeBuffer) for the large one, rounded up to the device's granularity. The
 *    range's last chunk is never mapped here, which keeps every page-mapped segment split.
 *  - Best fit first (get_free_block), in the (stream, kind) index as for plain segments, with
 *    one more rule: a free block is ranked by the size it could grow to (its size plus the
 *    unmapped block right after it), and the search moves on to the next block of the index
 *    while that one's growable size is smaller. The oversize rules of cp_size_fits follow.
 *  - When nothing fits (alloc_block, try_allocate_expandable_block, find_expandable_block):
 *    the UNMAPPED blocks of the (stream, kind) segments in address order; the first one that,
 *    together with a FREE block right before it and the FREE or UNMAPPED blocks after it, has
 *    room for the request is grown: chunks are mapped at its start (map_block: min(its size,
 *    what is missing), rounded up to chunks), they merge with the FREE neighbours, and so on
 *    until the block is large enough. With no such room, a new segment is reserved.
 *    Each mapping of a range counts one num_device_alloc (map_block), and reserved_bytes
 *    grows by the bytes mapped; the segment stat counts plain segments only, as torch's does.
 *  - Splitting: any remainder of at least one granule is split off, in both pools
 *    (should_split with expandable segments).
 *  - Memory is given back only on empty_cache and on the OOM ladder's retry
 *    (release_cached_blocks -> release_blocks -> unmap_block), after every pending free has
 *    been waited for and the segment's stream has finished its work (unmapHandles syncs the
 *    stream): the whole chunks inside each FREE block are unmapped, one num_device_free per
 *    range; a segment left wholly unmapped gives its address range back
 *    (release_expandable_segment).
 * Per chunk, mapping is page_create, page_map, page_release (the mapping keeps the memory;
 * a refused release is tried once more, as a page never released is lost to the device)
 * and page_set_access; the page-mapped calls run without the pool lock, with the range held
 * in a MAPPING or UNMAPPING block meanwhile (core/types.h). Where this differs from torch:
 * the cap counts the bytes really mapped, not the segment size a plain pool would reserve;
 * the retry searches the index again before growing (as the plain ladder does); free blocks
 * of page-mapped segments count in inactive_split (torch leaves them out); garbage collection
 * and release_before_grow give back plain segments only. */

/* Address space of a segment when the device's total is unknown. */
#define CP_EXPAND_DEFAULT_SPACE ((size_t)1 << 40)

void cp_expand_init(cp_pool_t *pool) {
  pool->paged = false;
  const cp_backend_t *be = &pool->backend;
  if (!(pool->cfg.expandable_segments || pool->cfg.page_stitching) || be->vmm_granularity == NULL ||
      be->va_reserve == NULL || be->va_free == NULL || be->page_create == NULL || be->page_release == NULL ||
      be->page_map == NULL || be->page_unmap == NULL || be->page_set_access == NULL) {
    return;
  }
  size_t g = 0;
  if (be->vmm_granularity(be->ctx, &g) != CP_OK || g == 0 || !cp_is_pow2(g)) return; /* plain segments */
  pool->vmm_granularity = g;
  pool->paged = true;
  pool->stitch = pool->cfg.page_stitching != 0;
}

size_t cp_expand_chunk(const cp_pool_t *pool, int kind) {
  if (pool->stitch) return pool->vmm_granularity; /* one page per mapping: pages stitch alone */
  size_t base = kind == CP_KIND_SMALL ? pool->cfg.small_segment : pool->cfg.large_segment;
  size_t g = pool->vmm_granularity;
  return (base + g - 1) / g * g;
}

/* The size a FREE block could grow to: itself and the unmapped block after it. */
/* Note [Handles follow growth]
 * With page_stitching, a growth maps exactly what the request lacks (whole granules, nothing
 * ahead), in physical handles of at most large_segment (20 MiB: the chunk expandable segments
 * map at a time), not one handle per granule. A cuMemCreate costs about the same fixed time
 * whatever its size (device_costs.py), so 2 MiB handles cost ten times the calls of 20 MiB
 * ones; and a handle is mapped and unmapped whole (the driver maps a handle from offset 0,
 * and cuMemUnmap takes whole mappings), so a stitched range and a release move whole handles
 * only (a handle partly in use can still open or close a stitched range: Note [Handles in
 * part use], stitch.c). The bound keeps both at the grain of expandable segments: no more handles per byte
 * than it creates, and memory given back in pieces no coarser than its chunks. Handles of
 * one growth are the pieces the program asked for, which it tends to free together.
 * seg->pages holds the handle at every granule it covers; a handle's edges are where the
 * value changes. Without page_stitching every mapping is one chunk, as in torch. */

/* The largest handle a mapping creates with kept handles: the large pool's chunk. */
static size_t cp_expand_handle_max(const cp_pool_t *pool) {
  const size_t g = pool->vmm_granularity;
  return pool->cfg.large_segment <= g ? g : pool->cfg.large_segment / g * g;
}

/* Whether `addr` (in `seg`) starts a handle: a chunk edge, and with kept handles a granule
 * whose handle is not the one before it. */
bool cp_expand_handle_edge(const cp_segment_t *seg, uintptr_t addr) {
  const size_t off = addr - seg->addr;
  if (off % seg->chunk != 0) return false;
  const size_t slot = off / seg->chunk;
  return slot == 0 || slot >= seg->page_slots || seg->pages[slot] == 0 || seg->pages[slot] != seg->pages[slot - 1];
}

/* The first handle edge at or above `addr`, and the last at or below it. */
uintptr_t cp_expand_edge_up(const cp_segment_t *seg, uintptr_t addr) {
  uintptr_t a = seg->addr + (addr - seg->addr + seg->chunk - 1) / seg->chunk * seg->chunk;
  while (!cp_expand_handle_edge(seg, a)) a += seg->chunk;
  return a;
}

uintptr_t cp_expand_edge_down(const cp_segment_t *seg, uintptr_t addr) {
  uintptr_t a = seg->addr + (addr - seg->addr) / seg->chunk * seg->chunk;
  while (!cp_expand_handle_edge(seg, a)) a -= seg->chunk;
  return a;
}

static size_t cp_expandable_size(const cp_block_t *b) {
  const cp_block_t *n = b->next;
  return b->size + (n != NULL && (n->state == CP_BLOCK_UNMAPPED || n->state == CP_BLOCK_MAPPING) ? n->size : 0);
}

/* Best fit with the growable-size rule (Note [Expandable segments]); the block leaves the
 * index. */
static cp_block_t *cp_expand_best_fit_locked(cp_pool_t *pool, cp_stream_state_t *st, int kind, size_t size) {
  cp_index_t *ix = &st->index[kind];
  cp_block_t *b = cp_index_lower_bound(ix, size);
  if (b == NULL) return NULL;
  for (cp_block_t *n = cp_index_next(ix, b); b->segment->paged && n != NULL; n = cp_index_next(ix, n)) {
    if (cp_expandable_size(n) >= cp_expandable_size(b)) break;
    b = n;
  }
  if (!cp_size_fits(&pool->cfg, size, b->size)) return NULL;
  cp_free_remove_locked(pool, b);
  return b;
}

/* Hand out the FREE block `b` (out of the index); the split rule of page-mapped pools. */
static int cp_expand_take_locked(cp_pool_t *pool, cp_block_t *b, size_t rounded, size_t size, void **out_ptr) {
  int rc = cp_reserve_metadata_locked(pool, 1);
  if (rc != CP_OK) {
    cp_block_merge_free_locked(pool, b);
    return rc;
  }
  if (b->size - rounded >= pool->cfg.granule) cp_free_insert_locked(pool, cp_block_cut_locked(pool, b, rounded));
  cp_block_make_live_locked(pool, b, size);
  *out_ptr = (void *)b->addr;
  return CP_OK;
}

int cp_expand_take_fit_locked(cp_pool_t *pool, cp_stream_state_t *st, int kind, size_t rounded, size_t size,
                              void **out_ptr) {
  cp_block_t *b = cp_expand_best_fit_locked(pool, st, kind, rounded);
  return b != NULL ? cp_expand_take_locked(pool, b, rounded, size, out_ptr) : CP_ERR_OOM;
}

/* Make `b` UNMAPPED and merge it with UNMAPPED neighbours. */
static cp_block_t *cp_expand_make_unmapped_locked(cp_pool_t *pool, cp_block_t *b) {
  b->state = CP_BLOCK_UNMAPPED;
  cp_block_t *p = b->prev;
  if (p != NULL && p->state == CP_BLOCK_UNMAPPED) {
    cp_block_delete_locked(pool, cp_block_absorb_next(p));
    b = p;
  }
  cp_block_t *n = b->next;
  if (n != NULL && n->state == CP_BLOCK_UNMAPPED) cp_block_delete_locked(pool, cp_block_absorb_next(b));
  return b;
}

/* ------------------------------------------------------------------------------------------
 * Segments
 * ---------------------------------------------------------------------------------------- */

/* A new page-mapped segment for (st, kind), wholly UNMAPPED. */
static int cp_expand_new_segment_locked(cp_pool_t *pool, cp_stream_state_t *st, int kind) {
  const size_t chunk = cp_expand_chunk(pool, kind);
  size_t total = pool->device_total != 0 ? pool->device_total : CP_EXPAND_DEFAULT_SPACE;
  size_t space = total + total / 8;
  if (space < total || space > SIZE_MAX - chunk) space = SIZE_MAX / 2;
  size_t chunks = (space + chunk - 1) / chunk;
  if (chunks < 2) chunks = 2;
  const size_t size = chunks * chunk;
  pthread_mutex_unlock(&pool->lock);
  uintptr_t addr = 0;
  int rc = CP_OK;
  cp_segment_t *seg = calloc(1, sizeof *seg);
  if (seg == NULL) rc = cp_set_error(CP_ERR_HOST_OOM, "cudapool: no host memory for a segment");
  if (rc == CP_OK) rc = pool->backend.va_reserve(pool->backend.ctx, size, &addr);
  pthread_mutex_lock(&pool->lock);
  if (rc == CP_OK) rc = cp_reserve_metadata_locked(pool, 1);
  if (rc != CP_OK) {
    if (seg != NULL && addr != 0) {
      pthread_mutex_unlock(&pool->lock);
      pool->backend.va_free(pool->backend.ctx, addr, size);
      pthread_mutex_lock(&pool->lock);
    }
    free(seg);
    return rc;
  }
  seg->addr = addr;
  seg->size = size;
  seg->chunk = chunk;
  seg->paged = true;
  seg->stream = st;
  seg->kind = (uint8_t)kind;
  (void)cp_segment_head_locked(pool, seg, CP_BLOCK_UNMAPPED);
  cp_segment_link_locked(pool, seg); /* no stats: only mapped bytes count */
  pool->paged_segments++;
  pool->address_space += size;
  return CP_OK;
}

/* Room for `size` bytes from `c` on: FREE and UNMAPPED blocks, the range's last chunk left out. */
static bool cp_expand_has_room(const cp_block_t *c, size_t size) {
  size_t bytes = 0;
  for (; c != NULL && bytes < size; c = c->next) {
    if (c->state == CP_BLOCK_FREE) {
      bytes += c->size;
    } else if (c->state == CP_BLOCK_UNMAPPED) {
      bytes += c->next == NULL ? c->size - c->segment->chunk : c->size;
    } else {
      break;
    }
  }
  return bytes >= size;
}

/* find_expandable_block: the block to grow from, or NULL when no segment has room. */
cp_block_t *cp_expand_find_locked(cp_pool_t *pool, cp_stream_state_t *st, int kind, size_t size) {
  uintptr_t after = 0;
  bool first = true;
  for (;;) {
    cp_segment_t *best = NULL;
    for (cp_segment_t *s = pool->segments; s != NULL; s = s->next) {
      if (!s->paged || s->stream != st || s->kind != kind || (!first && s->addr <= after)) continue;
      if (best == NULL || s->addr < best->addr) best = s;
    }
    if (best == NULL) return NULL;
    first = false;
    after = best->addr;
    for (cp_block_t *b = best->head; b != NULL; b = b->next) {
      if (b->state != CP_BLOCK_UNMAPPED) continue;
      cp_block_t *c = b->prev != NULL && b->prev->state == CP_BLOCK_FREE ? b->prev : b;
      if (cp_expand_has_room(c, size)) return c;
    }
  }
}

/* ------------------------------------------------------------------------------------------
 * Mapping
 * ---------------------------------------------------------------------------------------- */

/* page_release, once: after a failure the handle may already be gone (the driver reference
 * does not say it survives), so a second try could release another page's handle. */
static int cp_expand_page_release(const cp_backend_t *be, cp_page_t page) { return be->page_release(be->ctx, page); }

/* Unmap what was mapped but could not be given access, tried a second time when refused: left
 * mapped, it counts as memory the pool cannot hand out (it has no access). */
static int cp_expand_undo_map(const cp_backend_t *be, uintptr_t addr, size_t size) {
  int rc = be->page_unmap(be->ctx, addr, size);
  if (rc != CP_OK) rc = be->page_unmap(be->ctx, addr, size);
  return rc;
}

/* Room in seg->pages for the granules below `slots` (with page_stitching). */
int cp_expand_page_slots_locked(cp_segment_t *seg, size_t slots) {
  if (slots <= seg->page_slots) return CP_OK;
  size_t cap = seg->page_slots != 0 ? seg->page_slots : 64;
  while (cap < slots) cap *= 2;
  cp_page_t *grown = realloc(seg->pages, cap * sizeof *grown);
  if (grown == NULL) return CP_ERR_HOST_OOM;
  memset(grown + seg->page_slots, 0, (cap - seg->page_slots) * sizeof *grown);
  seg->pages = grown;
  seg->page_slots = cap;
  return CP_OK;
}

/* Map the first `bytes` (whole chunks) of the UNMAPPED block `u`, without the lock. On return
 * *out_free is the FREE block (in the index) that holds what was mapped, merged with its FREE
 * neighbours, or NULL when nothing was. Chunks mapped before a failure stay mapped, and the
 * failure is returned. */
int cp_expand_map_locked(cp_pool_t *pool, cp_block_t *u, size_t bytes, cp_block_t **out_free) {
  *out_free = NULL;
  cp_segment_t *seg = u->segment;
  const size_t held = cp_held_locked(pool);
  if (pool->cap_bytes != 0 && (bytes > pool->cap_bytes || held > pool->cap_bytes - bytes)) {
    return cp_set_error(CP_ERR_OOM, "cudapool: memory cap of %zu bytes reached", pool->cap_bytes);
  }
  int rc = cp_reserve_metadata_locked(pool, 2);
  if (rc != CP_OK) return rc;
  /* With page_stitching the pool keeps each page's handle (Note [Stitched ranges]); they are
   * gathered here and filed under the lock afterwards. Without room for them, pages are
   * released as usual and are then never stitched. */
  cp_page_t *kept = NULL;
  if (pool->stitch && cp_expand_page_slots_locked(seg, (u->addr - seg->addr + bytes) / seg->chunk) == CP_OK) {
    kept = calloc(bytes / seg->chunk, sizeof *kept);
  }
  if (u->size > bytes) cp_block_cut_locked(pool, u, bytes); /* the rest stays UNMAPPED */
  cp_block_t *spare = cp_block_new_locked(pool);            /* for a partial mapping */
  u->state = CP_BLOCK_MAPPING;
  const uintptr_t base = u->addr;
  const size_t chunk = seg->chunk;
  pool->inflight_bytes += bytes;
  pthread_mutex_unlock(&pool->lock);

  const cp_backend_t *be = &pool->backend;
  /* Kept handles: one for the whole mapping (Note [Handles follow growth]); else a chunk each. */
  const size_t most = cp_expand_handle_max(pool);
  size_t mapped = 0, maps = 0;
  while (mapped < bytes) {
    const uintptr_t a = base + mapped;
    const size_t unit = kept == NULL ? chunk : bytes - mapped < most ? bytes - mapped : most;
    cp_page_t page = 0;
    rc = be->page_create(be->ctx, unit, &page);
    if (rc != CP_OK) break;
    rc = be->page_map(be->ctx, a, unit, page);
    if (rc != CP_OK) {
      (void)cp_expand_page_release(be, page);
      break;
    }
    maps++;
    if (kept != NULL) { /* the pool keeps the handle; access is set once, below */
      for (size_t i = 0; i < unit / chunk; i++) kept[mapped / chunk + i] = page;
      mapped += unit;
      continue;
    }
    /* The mapping keeps the memory; it goes with the unmap. A refused release is not tried
     * again (the handle may be gone already): the mapping is still good, and at worst the
     * page outlives its unmap on the device. */
    (void)cp_expand_page_release(be, page);
    rc = be->page_set_access(be->ctx, a, chunk);
    if (rc != CP_OK) {
      /* Unusable without access: undo it. Should the device refuse that too, the chunk stays
       * mapped (and counted) and the next release unmaps it. */
      if (cp_expand_undo_map(be, a, chunk) != CP_OK) mapped += chunk;
      break;
    }
    mapped += chunk;
  }
  if (kept != NULL && mapped > 0) {
    /* One access call for every page mapped; refused, they are all undone as above. */
    const int access = be->page_set_access(be->ctx, base, mapped);
    if (access != CP_OK) {
      if (cp_expand_undo_map(be, base, mapped) == CP_OK) {
        for (size_t i = 0; i < mapped / chunk; i++) {
          if (i == 0 || kept[i] != kept[i - 1]) (void)cp_expand_page_release(be, kept[i]);
        }
        memset(kept, 0, mapped / chunk * sizeof *kept);
        mapped = 0;
      }
      if (rc == CP_OK) rc = access;
    }
  }

  pthread_mutex_lock(&pool->lock);
  pool->inflight_bytes -= bytes;
  pool->device_maps += maps;
  if (mapped < bytes) {
    cp_block_t *rest = u;
    if (mapped > 0) {
      /* `spare` takes the part not mapped. */
      spare->addr = u->addr + mapped;
      spare->size = u->size - mapped;
      spare->segment = seg;
      spare->prev = u;
      spare->next = u->next;
      if (u->next != NULL) u->next->prev = spare;
      u->next = spare;
      u->size = mapped;
      rest = spare;
      spare = NULL;
    }
    cp_expand_make_unmapped_locked(pool, rest);
  }
  if (spare != NULL) cp_block_delete_locked(pool, spare);
  if (kept != NULL) {
    memcpy(seg->pages + (base - seg->addr) / chunk, kept, mapped / chunk * sizeof *kept);
    free(kept);
  }
  if (mapped > 0) {
    CP_SEGMENT_EVENT(pool, CP_HIST_SEGMENT_MAP, u->addr, mapped, seg->stream->handle);
    seg->mapped += mapped;
    cp_stats_inc(&pool->stats, CP_STAT_RESERVED_BYTES, seg->kind, mapped);
    pool->stats.num_device_alloc++;
    const size_t now = cp_held_locked(pool);
    if (now > pool->high_water) pool->high_water = now;
    cp_block_t *p = u->prev;
    cp_block_t *into = p != NULL && p->state == CP_BLOCK_FREE ? p : u;
    cp_block_merge_free_locked(pool, u);
    *out_free = into;
  }
  return rc;
}

CP_COLD int cp_expand_paused_error(const cp_stream_state_t *st) {
  const char *name = cp_region_name(st->tag);
  return cp_set_error(CP_ERR_STATE,
                      "cudapool: region \"%s\" is paused: nothing can be allocated in it until it is resumed "
                      "(cudapool.resume)",
                      name != NULL ? name : "?");
}

int cp_expand_grow_locked(cp_pool_t *pool, cp_stream_state_t *st, int kind, size_t rounded, size_t size,
                          void **out_ptr) {
  const size_t chunk = cp_expand_chunk(pool, kind);
  for (int round = 0;; round++) {
    /* Each round maps memory or finds what others changed meanwhile; bounded all the same. */
    if (round == 1000) return cp_set_error(CP_ERR_OOM, "cudapool: page-mapped growth made no progress");
    int rc = cp_expand_refuse_paused(st); /* a new segment and each mapping let go of the lock */
    if (rc != CP_OK) return rc;
    cp_block_t *c = cp_expand_find_locked(pool, st, kind, rounded);
    if (c == NULL) {
      rc = cp_expand_new_segment_locked(pool, st, kind);
      if (rc == CP_OK) rc = cp_expand_refuse_paused(st);
      if (rc != CP_OK) return rc;
      c = cp_expand_find_locked(pool, st, kind, rounded);
      if (c == NULL) {
        return cp_set_error(CP_ERR_OOM, "cudapool: %zu bytes do not fit in a page-mapped segment of %zu-byte chunks",
                            rounded, chunk);
      }
    }
    for (;;) {
      if (c->state == CP_BLOCK_FREE && c->size >= rounded) {
        cp_free_remove_locked(pool, c);
        return cp_expand_take_locked(pool, c, rounded, size, out_ptr);
      }
      cp_block_t *u = c->state == CP_BLOCK_UNMAPPED ? c : c->next;
      if (u == NULL || u->state != CP_BLOCK_UNMAPPED) break; /* changed while unlocked: search again */
      const size_t have = c->state == CP_BLOCK_FREE ? c->size : 0;
      size_t room = u->next == NULL ? u->size - chunk : u->size;
      size_t want = rounded - have;
      if (want > room) want = room;
      if (want == 0) break;
      want = (want + chunk - 1) / chunk * chunk;
      cp_block_t *m = NULL;
      rc = cp_expand_map_locked(pool, u, want, &m);
      if (rc == CP_OK) rc = cp_expand_refuse_paused(st); /* what was mapped stays, free */
      if (rc != CP_OK) return rc;
      c = m;
    }
  }
}

/* ------------------------------------------------------------------------------------------
 * Unmapping
 * ---------------------------------------------------------------------------------------- */

cp_block_t *cp_expand_retire_range_locked(cp_pool_t *pool, cp_block_t *b, uintptr_t lo, uintptr_t hi) {
  if (cp_reserve_metadata_locked(pool, 2) != CP_OK) return NULL;
  cp_segment_t *seg = b->segment;
  cp_free_remove_locked(pool, b);
  cp_block_t *mid = b;
  if (lo > b->addr) {
    mid = cp_block_cut_locked(pool, b, lo - b->addr);
    cp_free_insert_locked(pool, b);
  }
  if (mid->addr + mid->size > hi) {
    cp_block_t *after = cp_block_cut_locked(pool, mid, hi - mid->addr);
    cp_free_insert_locked(pool, after);
  }
  mid->state = CP_BLOCK_DRAINING;
  pool->draining_bytes += mid->size;
  seg->stream->draining_bytes += mid->size;
  return mid;
}

void cp_expand_revive_locked(cp_pool_t *pool, cp_segment_t *seg) {
  for (cp_block_t *b = seg->head, *next; b != NULL; b = next) {
    next = b->next;
    if (b->state != CP_BLOCK_DRAINING) continue;
    pool->draining_bytes -= b->size;
    seg->stream->draining_bytes -= b->size;
    b->state = CP_BLOCK_FREE;
    cp_block_t *p = b->prev;
    cp_block_t *into = p != NULL && p->state == CP_BLOCK_FREE ? p : b;
    cp_block_merge_free_locked(pool, b);
    next = into->next; /* the merge may have taken `next` in */
  }
}

/* An UNMAPPING block and what became of it. */
typedef struct cp_range_s {
  cp_block_t *block;
  uintptr_t addr;
  size_t size;
  bool unmapped;
} cp_range_t;

/* Give back the address range of a wholly unmapped segment. */
static int cp_expand_drop_segment_locked(cp_pool_t *pool, cp_segment_t *seg) {
  cp_segment_unlink_locked(pool, seg);
  pool->paged_segments--;
  pool->address_space -= seg->size;
  pthread_mutex_unlock(&pool->lock);
  int rc = pool->backend.va_free(pool->backend.ctx, seg->addr, seg->size);
  pthread_mutex_lock(&pool->lock);
  if (rc != CP_OK) { /* keep it: still a valid, empty segment */
    cp_segment_link_locked(pool, seg);
    pool->paged_segments++;
    pool->address_space += seg->size;
    return rc;
  }
  cp_block_delete_locked(pool, seg->head);
  free(seg->pages);
  free(seg->spans);
  free(seg);
  return CP_OK;
}

int cp_expand_drop_unmapped_locked(cp_pool_t *pool) {
  int first_rc = CP_OK;
  for (bool again = true; again;) {
    again = false;
    for (cp_segment_t *seg = pool->segments; seg != NULL; seg = seg->next) {
      if (!seg->paged || seg->head->state != CP_BLOCK_UNMAPPED || seg->head->next != NULL || seg->drop_failed) continue;
      const int rc = cp_expand_drop_segment_locked(pool, seg); /* the lock drops: walk again */
      if (rc != CP_OK) {
        seg->drop_failed = true;
        if (first_rc == CP_OK) first_rc = rc;
      }
      again = true;
      break;
    }
  }
  for (cp_segment_t *seg = pool->segments; seg != NULL; seg = seg->next) seg->drop_failed = false;
  return first_rc;
}

/* The DRAINING blocks of `seg` become UNMAPPING, listed in *out (allocated); how many. Their
 * bytes leave what is reserved from here on, as segments being released do: once the device
 * has them back, another thread may map them anew, and counting both would put reserved above
 * what the device holds. A range the device refuses to unmap comes back. */
static size_t cp_expand_take_draining_locked(cp_pool_t *pool, cp_segment_t *seg, cp_range_t **out) {
  size_t n = 0;
  for (const cp_block_t *b = seg->head; b != NULL; b = b->next) n += b->state == CP_BLOCK_DRAINING;
  *out = n != 0 ? malloc(n * sizeof **out) : NULL;
  if (*out == NULL) return 0; /* nothing to do, or no host memory (the caller tells them apart) */
  size_t i = 0;
  for (cp_block_t *b = seg->head; b != NULL; b = b->next) {
    if (b->state != CP_BLOCK_DRAINING) continue;
    b->state = CP_BLOCK_UNMAPPING;
    pool->draining_bytes -= b->size;
    seg->stream->draining_bytes -= b->size;
    seg->mapped -= b->size;
    cp_stats_dec(&pool->stats, CP_STAT_RESERVED_BYTES, seg->kind, b->size);
    (*out)[i++] = (cp_range_t){b, b->addr, b->size, false};
  }
  return n;
}

int cp_expand_unmap_draining_locked(cp_pool_t *pool, cp_segment_t *seg, bool *out_dropped) {
  *out_dropped = false;
  cp_range_t *ranges = NULL;
  const size_t n = cp_expand_take_draining_locked(pool, seg, &ranges);
  int rc = CP_OK;
  if (n == 0) {
    for (const cp_block_t *b = seg->head; b != NULL; b = b->next) {
      if (b->state != CP_BLOCK_DRAINING) continue;
      cp_expand_revive_locked(pool, seg); /* no host memory for the list: kept for a later try */
      return cp_set_error(CP_ERR_HOST_OOM, "cudapool: no host memory to unmap");
    }
  }
  /* With page_stitching the pool holds the pages' handles: released after their unmap. */
  cp_page_t *handles = NULL;
  size_t *counts = NULL; /* handles per range (a range is whole handles) */
  if (n > 0 && seg->page_slots != 0) {
    size_t total = 0;
    for (size_t i = 0; i < n; i++) total += ranges[i].size / seg->chunk;
    handles = malloc(total * sizeof *handles);
    counts = calloc(n, sizeof *counts);
    if (handles == NULL || counts == NULL) {
      free(handles);
      handles = NULL;
      rc = cp_set_error(CP_ERR_HOST_OOM, "cudapool: no host memory to release pages");
    }
    for (size_t i = 0, h = 0; handles != NULL && i < n; i++) {
      for (uintptr_t a = ranges[i].addr; a < ranges[i].addr + ranges[i].size; a += seg->chunk) {
        const size_t slot = (a - seg->addr) / seg->chunk;
        if (a != ranges[i].addr && !cp_expand_handle_edge(seg, a)) continue; /* the same handle */
        handles[h++] = slot < seg->page_slots ? seg->pages[slot] : 0;
        counts[i]++;
      }
    }
  }
  if (n > 0) {
    pthread_mutex_unlock(&pool->lock);
    size_t calls = 0;
    for (size_t i = 0, h = 0; i < n && rc == CP_OK; i++) {
      const int r = pool->backend.page_unmap(pool->backend.ctx, ranges[i].addr, ranges[i].size);
      calls++;
      ranges[i].unmapped = r == CP_OK;
      if (r != CP_OK) rc = r;
      /* One release per handle: after a failure the handle may be gone already. */
      for (size_t k = 0; handles != NULL && k < counts[i]; k++, h++) {
        if (r == CP_OK && handles[h] != 0) (void)pool->backend.page_release(pool->backend.ctx, handles[h]);
      }
    }
    pthread_mutex_lock(&pool->lock);
    pool->device_unmaps += calls;
    for (size_t i = 0; i < n; i++) {
      cp_block_t *b = ranges[i].block;
      if (ranges[i].unmapped) {
        for (uintptr_t a = b->addr; a < b->addr + b->size && seg->page_slots != 0; a += seg->chunk) {
          const size_t slot = (a - seg->addr) / seg->chunk;
          if (slot < seg->page_slots) seg->pages[slot] = 0;
        }
        CP_SEGMENT_EVENT(pool, CP_HIST_SEGMENT_UNMAP, b->addr, b->size, seg->stream->handle);
        pool->stats.num_device_free++;
        cp_expand_make_unmapped_locked(pool, b);
      } else {
        seg->mapped += b->size;
        cp_stats_inc(&pool->stats, CP_STAT_RESERVED_BYTES, seg->kind, b->size);
        b->state = CP_BLOCK_FREE;
        cp_block_merge_free_locked(pool, b);
      }
    }
  }
  free(handles);
  free(counts);
  free(ranges);
  if (seg->head->state == CP_BLOCK_UNMAPPED && seg->head->next == NULL) {
    const int r = cp_expand_drop_segment_locked(pool, seg);
    if (r == CP_OK) *out_dropped = true;
    if (rc == CP_OK) rc = r;
  }
  return rc;
}

bool cp_expand_paused_span(const cp_segment_t *seg, uintptr_t addr, size_t size) {
  for (size_t i = 0; i < seg->span_count; i++) {
    if (seg->spans[i].addr == addr && seg->spans[i].size == size) return true;
  }
  return false;
}

void cp_expand_destroy_segment(cp_pool_t *pool, cp_segment_t *seg) {
  const cp_backend_t *be = &pool->backend;
  cp_block_t *b = seg->head;
  while (b != NULL) {
    if (b->state == CP_BLOCK_UNMAPPED || b->state == CP_BLOCK_MAPPING) {
      b = b->next;
      continue;
    }
    uintptr_t start = b->addr;
    size_t len = 0;
    for (; b != NULL && b->state != CP_BLOCK_UNMAPPED && b->state != CP_BLOCK_MAPPING; b = b->next) len += b->size;
    if (!cp_expand_paused_span(seg, start, len)) be->page_unmap(be->ctx, start, len);
  }
  free(seg->spans);
  for (size_t i = 0; i < seg->page_slots; i++) {
    if (seg->pages[i] != 0 && (i == 0 || seg->pages[i] != seg->pages[i - 1]))
      (void)cp_expand_page_release(be, seg->pages[i]);
  }
  free(seg->pages);
  be->va_free(be->ctx, seg->addr, seg->size);
}
