/* history.c — snapshots and history: a copy of every segment and block of a pool, and a ring
 * buffer of what the pool did. Owns: cp_history_t and the snapshot arrays. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/history.h"
#include "core/snapshot.h"

/* Note [History]
 * Recording is off by default and then costs one predictable branch per operation
 * (CP_HISTORY: pool->history is NULL). When on, each event writes one fixed-size record into
 * a ring under the pool lock: no allocation, no call out, one clock read. The records carry
 * what torch's trace entries carry (action, address, size, stream, time) plus a sequence
 * number and a context: an opaque id the thread set before the operation
 * (cp_history_set_context). Bindings use it to name the Python stack that made an allocation;
 * they capture that stack before calling in, without the pool lock, so the core never waits
 * on an interpreter. Points recorded: an allocation (ALLOC), a free (FREE_REQUESTED; also
 * FREE_COMPLETED when no other stream used the block, else when its events complete), a plain
 * segment reserved or given back (SEGMENT_ALLOC / SEGMENT_FREE), chunks of a page-mapped
 * segment mapped or unmapped (SEGMENT_MAP / SEGMENT_UNMAP), a failed allocation (OOM), and a
 * binding's note on a live allocation (ANNOTATE, cp_pool_history_annotate). Every record also
 * carries the recording thread's tag (cp_history_set_tag): a binding's label, kept for as long
 * as the thread keeps it set (torch's user metadata). */

_Static_assert((int)CP_SNAP_FREE == (int)CP_BLOCK_FREE && (int)CP_SNAP_LIVE == (int)CP_BLOCK_LIVE &&
                   (int)CP_SNAP_PENDING == (int)CP_BLOCK_PENDING && (int)CP_SNAP_UNMAPPED == (int)CP_BLOCK_UNMAPPED &&
                   (int)CP_SNAP_MAPPING == (int)CP_BLOCK_MAPPING && (int)CP_SNAP_UNMAPPING == (int)CP_BLOCK_UNMAPPING &&
                   (int)CP_SNAP_LENT == (int)CP_BLOCK_LENT && (int)CP_SNAP_DRAINING == (int)CP_BLOCK_DRAINING,
               "snapshot block states are the core's block states");
_Static_assert(sizeof(cp_history_entry_t) == 56, "a history record is 56 bytes");

const char *const cp_history_action_names[CP_HIST_ACTION_COUNT] = {
#define CP_X(id, name) name,
    CP_HISTORY_ACTIONS(CP_X)
#undef CP_X
};

static _Thread_local uint64_t cp_history_context;
static _Thread_local uint32_t cp_history_tag;

void cp_history_set_context(uint64_t context) { cp_history_context = context; }
void cp_history_set_tag(uint32_t tag) { cp_history_tag = tag; }

/* ------------------------------------------------------------------------------------------
 * Snapshots
 * ---------------------------------------------------------------------------------------- */

static int cp_segment_by_addr(const void *a, const void *b) {
  const cp_snapshot_segment_t *x = a, *y = b;
  return x->addr < y->addr ? -1 : x->addr > y->addr;
}

void cp_snapshot_free(cp_snapshot_t *snap) {
  if (snap == NULL) return;
  free(snap->segments);
  free(snap->blocks);
  memset(snap, 0, sizeof *snap);
}

/* The records of the step plan's bin `bin` (a block of a segment) from blocks[bi] on: its
 * planned blocks in use, in address order, and the free gaps between them. Returns the next
 * record's index. */
static size_t cp_snapshot_plan_bin(const cp_plan_t *pl, const cp_block_t *bin, const cp_block_t **nodes,
                                   cp_snapshot_block_t *blocks, size_t bi) {
  size_t n = 0;
  for (uint32_t j = 0; j < pl->count; j++) {
    const cp_block_t *node = &pl->entries[j].node;
    if (node->state != CP_BLOCK_FREE && pl->entries[j].planned && pl->bins[pl->entries[j].bin] == bin)
      nodes[n++] = node;
  }
  qsort(nodes, n, sizeof *nodes, cp_block_ptr_by_addr);
  uintptr_t at = bin->addr;
  for (size_t i = 0; i <= n; i++) {
    const uintptr_t next = i < n ? nodes[i]->addr : bin->addr + bin->size;
    if (next > at) blocks[bi++] = (cp_snapshot_block_t){.addr = at, .size = next - at, .state = CP_BLOCK_FREE};
    if (i == n) break;
    blocks[bi++] = (cp_snapshot_block_t){
        .addr = nodes[i]->addr, .size = nodes[i]->size, .requested = nodes[i]->requested, .state = nodes[i]->state};
    at = nodes[i]->addr + nodes[i]->size;
  }
  return bi;
}

int cp_pool_snapshot(cp_pool_t *pool, cp_snapshot_t *out) {
  if (out == NULL) return cp_set_error(CP_ERR_INVALID, "cp_pool_snapshot: NULL argument");
  memset(out, 0, sizeof *out);
  if (pool == NULL) return cp_set_error(CP_ERR_INVALID, "cp_pool_snapshot: NULL pool");
  pthread_mutex_lock(&pool->lock);
  size_t nblocks = 0;
  for (const cp_segment_t *seg = pool->segments; seg != NULL; seg = seg->next)
    for (const cp_block_t *b = seg->head; b != NULL; b = b->next) nblocks++;
  /* A step plan's bin shows as the planned blocks in use in it and the gaps between. */
  const cp_plan_t *pl = &pool->plan;
  if (pl->bins != NULL) nblocks += 2 * (size_t)pl->count + pl->bin_count;
  const cp_block_t **nodes = pl->bins != NULL ? malloc(((size_t)pl->count + 1) * sizeof *nodes) : NULL;
  const size_t nsegs = pool->segment_count;
  cp_snapshot_segment_t *segs = calloc(nsegs > 0 ? nsegs : 1, sizeof *segs);
  cp_snapshot_block_t *blocks = calloc(nblocks > 0 ? nblocks : 1, sizeof *blocks);
  if (segs == NULL || blocks == NULL || (pl->bins != NULL && nodes == NULL)) {
    pthread_mutex_unlock(&pool->lock);
    free(segs);
    free(blocks);
    free(nodes);
    return cp_set_error(CP_ERR_HOST_OOM, "cp_pool_snapshot: no host memory for %zu segments and %zu blocks", nsegs,
                        nblocks);
  }
  size_t si = 0, bi = 0;
  for (const cp_segment_t *seg = pool->segments; seg != NULL; seg = seg->next, si++) {
    cp_snapshot_segment_t *s = &segs[si];
    s->addr = seg->addr;
    s->size = seg->size;
    s->mapped = seg->paged ? seg->mapped : seg->size;
    s->stream = seg->stream->handle;
    s->kind = seg->kind;
    s->page_mapped = seg->paged;
    s->tag = seg->stream->tag;
    s->paused = seg->paused;
    s->first_block = bi;
    for (const cp_block_t *b = seg->head; b != NULL; b = b->next) {
      if (b->plan == CP_PLAN_RANGE) {
        bi = cp_snapshot_plan_bin(pl, b, nodes, blocks, bi);
        continue;
      }
      blocks[bi].addr = b->addr;
      blocks[bi].size = b->size;
      blocks[bi].requested = b->state == CP_BLOCK_LIVE || b->state == CP_BLOCK_PENDING ? b->requested : 0;
      blocks[bi].state = b->state;
      bi++;
    }
    s->block_count = bi - s->first_block;
  }
  nblocks = bi;
  pthread_mutex_unlock(&pool->lock);
  free(nodes);
  /* Each segment's blocks stay where they are: sorting moves only the segment records. */
  qsort(segs, nsegs, sizeof *segs, cp_segment_by_addr);
  out->segments = segs;
  out->segment_count = nsegs;
  out->blocks = blocks;
  out->block_count = nblocks;
  return CP_OK;
}

int cp_snapshot_torch_state(int state) {
  switch (state) {
    case CP_SNAP_LIVE:
    case CP_SNAP_LENT: return CP_TORCH_ALLOCATED;
    case CP_SNAP_PENDING: return CP_TORCH_PENDING;
    case CP_SNAP_UNMAPPED:
    case CP_SNAP_MAPPING: return CP_TORCH_NO_MEMORY;
    default: return CP_TORCH_INACTIVE;
  }
}

int cp_snapshot_next_run(const cp_snapshot_t *snap, const cp_snapshot_segment_t *seg, size_t *pos,
                         cp_snapshot_run_t *out) {
  const cp_snapshot_block_t *blocks = snap->blocks + seg->first_block;
  size_t i = *pos;
  while (i < seg->block_count && cp_snapshot_torch_state(blocks[i].state) == CP_TORCH_NO_MEMORY) i++;
  if (i == seg->block_count) {
    *pos = i;
    return 0;
  }
  memset(out, 0, sizeof *out);
  out->first_block = seg->first_block + i;
  out->addr = blocks[i].addr;
  for (; i < seg->block_count; i++) {
    const int state = cp_snapshot_torch_state(blocks[i].state);
    if (state == CP_TORCH_NO_MEMORY) break;
    out->block_count++;
    out->total_size += blocks[i].size;
    if (state == CP_TORCH_INACTIVE) continue;
    out->active_size += blocks[i].size;
    out->requested_size += blocks[i].requested;
    if (state == CP_TORCH_ALLOCATED) out->allocated_size += blocks[i].size;
  }
  *pos = i;
  return 1;
}

/* ------------------------------------------------------------------------------------------
 * History
 * ---------------------------------------------------------------------------------------- */

void cp_history_record_locked(cp_pool_t *pool, int action, uintptr_t addr, size_t size, cp_stream_t stream) {
  cp_history_t *h = pool->history;
  cp_history_entry_t *e = &h->ring[h->head];
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  e->seq = ++pool->history_seq;
  e->time_ns = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
  e->addr = addr;
  e->size = size;
  e->stream = (uint64_t)stream;
  e->context =
      action == CP_HIST_ALLOC || action == CP_HIST_FREE_REQUESTED || action == CP_HIST_OOM || action == CP_HIST_ANNOTATE
          ? cp_history_context
          : 0;
  e->action = (uint32_t)action;
  e->tag = cp_history_tag;
  h->head = h->head + 1 == h->capacity ? 0 : h->head + 1;
  if (h->count < h->capacity) h->count++;
}

void cp_history_free_locked(cp_pool_t *pool, const cp_block_t *b) {
  const cp_stream_t stream = b->segment->stream->handle;
  cp_history_record_locked(pool, CP_HIST_FREE_REQUESTED, b->addr, b->size, stream);
  if (b->state == CP_BLOCK_LIVE) cp_history_record_locked(pool, CP_HIST_FREE_COMPLETED, b->addr, b->size, stream);
}

void cp_history_alloc_locked(cp_pool_t *pool, int rc, const void *ptr, size_t size, cp_stream_t stream) {
  if (rc == CP_OK && ptr != NULL) {
    const cp_block_t *b = cp_ptrmap_get(&pool->live, (uintptr_t)ptr);
    if (b != NULL) cp_history_record_locked(pool, CP_HIST_ALLOC, b->addr, b->size, stream);
  } else if (rc == CP_ERR_OOM) {
    cp_history_record_locked(pool, CP_HIST_OOM, 0, size, stream);
  }
}

int cp_pool_history_annotate(cp_pool_t *pool, const void *ptr, uint32_t tag) {
  if (pool == NULL) return cp_set_error(CP_ERR_INVALID, "cp_pool_history_annotate: NULL pool");
  pthread_mutex_lock(&pool->lock);
  const cp_block_t *b = ptr != NULL ? cp_ptrmap_get(&pool->live, (uintptr_t)ptr) : NULL;
  if (b != NULL && pool->history != NULL) {
    const uint32_t own = cp_history_tag;
    cp_history_tag = tag; /* the record carries the annotation's tag, not the thread's */
    cp_history_record_locked(pool, CP_HIST_ANNOTATE, b->addr, b->size, b->segment->stream->handle);
    cp_history_tag = own;
  }
  pthread_mutex_unlock(&pool->lock);
  if (b == NULL) return cp_set_error(CP_ERR_INVALID, "cudapool: %p is not a live allocation of the pool", ptr);
  return CP_OK;
}

static void cp_history_free_ring(cp_history_t *h) {
  if (h == NULL) return;
  free(h->ring);
  free(h);
}

void cp_history_destroy(cp_pool_t *pool) {
  cp_history_free_ring(pool->history);
  pool->history = NULL;
}

int cp_pool_history_enable(cp_pool_t *pool, size_t max_entries) {
  if (pool == NULL) return cp_set_error(CP_ERR_INVALID, "cp_pool_history_enable: NULL pool");
  if (max_entries > SIZE_MAX / sizeof(cp_history_entry_t)) {
    return cp_set_error(CP_ERR_INVALID, "cp_pool_history_enable: %zu entries do not fit in memory", max_entries);
  }
  cp_history_t *h = NULL;
  if (max_entries > 0) { /* made without the lock: nothing blocks under it */
    h = calloc(1, sizeof *h);
    if (h != NULL) h->ring = malloc(max_entries * sizeof *h->ring);
    if (h == NULL || h->ring == NULL) {
      cp_history_free_ring(h);
      h = NULL;
    } else {
      h->capacity = max_entries;
    }
  }
  pthread_mutex_lock(&pool->lock);
  cp_history_t *old = pool->history;
  pool->history = h;
  pthread_mutex_unlock(&pool->lock);
  cp_history_free_ring(old);
  if (max_entries > 0 && h == NULL) {
    return cp_set_error(CP_ERR_HOST_OOM, "cp_pool_history_enable: no host memory for %zu entries", max_entries);
  }
  return CP_OK;
}

int cp_pool_set_segment_observer(cp_pool_t *pool, cp_segment_observer_t fn, void *ctx) {
  if (pool == NULL) return cp_set_error(CP_ERR_INVALID, "cp_pool_set_segment_observer: NULL pool");
  pthread_mutex_lock(&pool->lock);
  pool->segment_observer = fn;
  pool->segment_observer_ctx = fn != NULL ? ctx : NULL;
  pthread_mutex_unlock(&pool->lock);
  return CP_OK;
}

size_t cp_pool_history_read(cp_pool_t *pool, cp_history_entry_t *out, size_t cap, uint64_t *out_recorded,
                            size_t *out_capacity) {
  if (pool == NULL) {
    if (out_recorded != NULL) *out_recorded = 0;
    if (out_capacity != NULL) *out_capacity = 0;
    return 0;
  }
  pthread_mutex_lock(&pool->lock);
  const cp_history_t *h = pool->history;
  size_t n = 0;
  if (h != NULL && out != NULL) {
    n = h->count < cap ? h->count : cap;
    /* The newest n: they start n records before head. */
    size_t i = (h->head + h->capacity - n) % h->capacity;
    for (size_t k = 0; k < n; k++) {
      out[k] = h->ring[i];
      i = i + 1 == h->capacity ? 0 : i + 1;
    }
  }
  if (out_recorded != NULL) *out_recorded = pool->history_seq;
  if (out_capacity != NULL) *out_capacity = h != NULL ? h->capacity : 0;
  pthread_mutex_unlock(&pool->lock);
  return n;
}
