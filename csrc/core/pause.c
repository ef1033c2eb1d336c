/* pause.c — regions paused and resumed: the physical memory of a region given back while its
 * blocks keep their addresses, and mapped again at the same addresses later.
 * Owns: the paused state of stream states, segments and stitched ranges, and the backups. */
#include <sched.h>
#include <stdlib.h>
#include <string.h>

#include "core/capture.h"
#include "core/check.h"
#include "core/drain.h"
#include "core/expand.h"
#include "core/history.h"
#include "core/pause.h"
#include "core/pool.h"

/* Note [Paused regions]
 * A region's memory (Note [Regions], region.c) lives in page-mapped segments of its own
 * stream states, so it can be given back without moving a block: the pages behind its
 * addresses are unmapped and released, the address ranges stay reserved, and every block keeps
 * its state (a live block stays live: the tensor over it is still a valid object, only its
 * memory is gone). The order is the one memory given back always follows (Note
 * [Stream-ordered release], drain.c), with a wait in place of the drain event:
 *  1. The region's states go out of service (`paused`): an allocation in it fails, and no
 *     other thread retires, trims or reaps its memory from then on. A thread that is mapping
 *     or unmapping its memory right now (the lock dropped) is waited for.
 *  2. Stream-ordered wait: one event is recorded on each stream its memory serves and on each
 *     stream a live or pending block of it was used on (record_stream), and each is waited
 *     for (event_synchronize: those streams only, never the whole device). Work of those
 *     streams queued before the pause is then done, and pending frees come back.
 *  3. Its free memory goes back as empty_cache would give it (free whole handles unmapped,
 *     idle stitched ranges dropped), at once: step 2 waited for its streams. Not for a CUDA
 *     graph's pool (CP_PAUSE_KEEP_FREE): its replays use the addresses of blocks freed during
 *     the capture, so every mapped byte is paused and mapped again.
 *  4. With a backup, the bytes of every live block (its requested size) are copied to pinned
 *     host memory.
 *  5. Unmap: every stitched range still mapped (whole, one call each), then every maximal
 *     stretch of mapped blocks of its segments (one call each; a stretch covers whole
 *     mappings), then one release per kept handle. The stretches are listed on the segment;
 *     their bytes leave reserved_bytes and are counted as paused.
 * Resume maps a new page for each piece of a stretch, where a piece is the stretch cut at the
 * edges of the runs of the region's stitched ranges (so each run is whole pieces and can be
 * mapped again at its range) and, without kept handles, at every chunk edge (each chunk is a
 * handle there, Note [Expandable segments]); one access call per stretch, then the stitched
 * ranges are mapped again from the same pages (one access call per range), then the backups
 * are copied back. Resume is all or nothing: a failure unmaps and releases what it made, and
 * the region stays paused with its backups. A pause is undone whole when the wait, a backup or
 * the first unmap fails (nothing was given back yet); a later stretch the device refuses to
 * unmap, twice, stays mapped and reserved (reported), and resume leaves it as it is. A pause
 * or resume runs with the lock dropped around device calls; the states' `busy` flag keeps a
 * second pause or resume of the same states out meanwhile. Nothing is paused or resumed during
 * a capture. */

/* Whether `st` belongs to region `tag` (0: every region). */
static bool cp_pause_match(const cp_stream_state_t *st, uint32_t tag) {
  return st->tag != 0 && (tag == 0 || st->tag == tag);
}

/* pause.h */
int cp_pause_grow(void **items, size_t *cap, size_t need, size_t item_size) {
  if (need <= *cap) return CP_OK;
  size_t n = *cap != 0 ? *cap * 2 : 16;
  while (n < need) n *= 2;
  void *grown = realloc(*items, n * item_size);
  if (grown == NULL) return cp_set_error(CP_ERR_HOST_OOM, "cudapool: no host memory to pause or resume a region");
  *items = grown;
  *cap = n;
  return CP_OK;
}

static int cp_pause_add_stream(cp_stream_t **list, size_t *n, size_t *cap, cp_stream_t s) {
  for (size_t i = 0; i < *n; i++) {
    if ((*list)[i] == s) return CP_OK;
  }
  int rc = cp_pause_grow((void **)list, cap, *n + 1, sizeof **list);
  if (rc == CP_OK) (*list)[(*n)++] = s;
  return rc;
}

/* The states of region `tag` that are (paused == want) and not busy; each marked busy. */
int cp_pause_take_states_locked(cp_pool_t *pool, uint32_t tag, bool want, cp_stream_state_t ***out, size_t *out_n) {
  *out = NULL;
  *out_n = 0;
  for (;;) {
    bool busy = false;
    size_t n = 0;
    for (size_t i = 0; i < pool->streams.count; i++) {
      const cp_stream_state_t *st = pool->streams.list[i];
      if (!cp_pause_match(st, tag)) continue;
      busy = busy || st->busy;
      n += st->paused == want;
    }
    if (!busy) {
      if (n == 0) return CP_OK;
      cp_stream_state_t **sts = malloc(n * sizeof *sts);
      if (sts == NULL) return cp_set_error(CP_ERR_HOST_OOM, "cudapool: no host memory to pause or resume a region");
      size_t k = 0;
      for (size_t i = 0; i < pool->streams.count; i++) {
        cp_stream_state_t *st = pool->streams.list[i];
        if (cp_pause_match(st, tag) && st->paused == want) {
          st->busy = true;
          sts[k++] = st;
        }
      }
      *out = sts;
      *out_n = n;
      return CP_OK;
    }
    /* Another thread pauses or resumes some of them: its device calls take long. */
    pthread_mutex_unlock(&pool->lock);
    sched_yield();
    pthread_mutex_lock(&pool->lock);
  }
}

void cp_pause_put_states_locked(cp_stream_state_t **sts, size_t n) {
  for (size_t i = 0; i < n; i++) sts[i]->busy = false;
  free(sts);
}

static bool cp_pause_in(cp_stream_state_t *const *sts, size_t n, const cp_stream_state_t *st) {
  for (size_t i = 0; i < n; i++) {
    if (sts[i] == st) return true;
  }
  return false;
}

/* pause.h */
void cp_pause_drop_backups_locked(cp_pool_t *pool, cp_stream_state_t *st) {
  if (st->backup_count == 0) return;
  cp_stream_state_t held = {0};
  held.backups = st->backups;
  held.backup_count = st->backup_count;
  pool->backup_bytes -= st->backup_bytes;
  st->backups = NULL;
  st->backup_count = 0;
  st->backup_bytes = 0;
  pthread_mutex_unlock(&pool->lock);
  cp_streams_drop_backups(&pool->streams, &held);
  pthread_mutex_lock(&pool->lock);
}

/* pause.h */
int cp_pause_refuse_locked(const cp_pool_t *pool, const char *who) {
  if (pool->capture.windows != 0) {
    return cp_set_error(CP_ERR_STATE, "%s: a CUDA graph is being captured: regions cannot be paused or resumed now",
                        who);
  }
  if (!pool->paged) {
    return cp_set_error(CP_ERR_STATE,
                        "%s: this pool has no page-mapped memory (policy builtin, or a device without the virtual "
                        "memory API): nothing in it can be paused",
                        who);
  }
  return CP_OK;
}

/* ------------------------------------------------------------------------------------------
 * Pause, steps 1-2: out of service, settled, and the streams waited for
 * ---------------------------------------------------------------------------------------- */

/* Whether a thread is changing the mapping of `st`'s memory right now (lock dropped). */
static bool cp_pause_unsettled_locked(const cp_pool_t *pool, const cp_stream_state_t *st) {
  if (st->reaping) return true;
  for (const cp_segment_t *seg = pool->segments; seg != NULL; seg = seg->next) {
    if (!seg->paged || seg->stream != st) continue;
    for (const cp_block_t *b = seg->head; b != NULL; b = b->next) {
      if (b->state == CP_BLOCK_MAPPING || b->state == CP_BLOCK_UNMAPPING) return true;
    }
  }
  return false;
}

static void cp_pause_settle_locked(cp_pool_t *pool, cp_stream_state_t *const *sts, size_t n) {
  for (;;) {
    bool unsettled = pool->stitch_inflight != 0;
    for (size_t i = 0; i < n && !unsettled; i++) unsettled = cp_pause_unsettled_locked(pool, sts[i]);
    if (!unsettled) return;
    pthread_mutex_unlock(&pool->lock);
    sched_yield();
    pthread_mutex_lock(&pool->lock);
  }
}

/* The uses (record_stream) of a live or pending block. */
static int cp_pause_add_uses(cp_stream_t **list, size_t *n, size_t *cap, const cp_block_t *b) {
  int rc = CP_OK;
  if (b->state != CP_BLOCK_LIVE && b->state != CP_BLOCK_PENDING) return CP_OK;
  for (uint32_t u = 0; u < b->use_count && rc == CP_OK; u++) rc = cp_pause_add_stream(list, n, cap, b->uses[u]);
  return rc;
}

/* Step 2: an event on every stream the states' memory serves or was used on, each waited for
 * with the lock dropped. */
static int cp_pause_wait_locked(cp_pool_t *pool, cp_stream_state_t *const *sts, size_t n) {
  cp_stream_t *streams = NULL;
  size_t ns = 0, cap = 0;
  int rc = CP_OK;
  for (size_t i = 0; i < n && rc == CP_OK; i++) rc = cp_pause_add_stream(&streams, &ns, &cap, sts[i]->handle);
  for (const cp_segment_t *seg = pool->segments; seg != NULL && rc == CP_OK; seg = seg->next) {
    if (!seg->paged || !cp_pause_in(sts, n, seg->stream)) continue;
    for (const cp_block_t *b = seg->head; b != NULL && rc == CP_OK; b = b->next)
      rc = cp_pause_add_uses(&streams, &ns, &cap, b);
  }
  for (const cp_segment_t *s = pool->stitched; s != NULL && rc == CP_OK; s = s->next) {
    if (cp_pause_in(sts, n, s->stream)) rc = cp_pause_add_uses(&streams, &ns, &cap, s->head);
  }
  cp_event_t *events = rc == CP_OK ? calloc(ns, sizeof *events) : NULL;
  if (rc == CP_OK && events == NULL) rc = cp_set_error(CP_ERR_HOST_OOM, "cudapool: no host memory to pause a region");
  size_t made = 0;
  const cp_backend_t *be = &pool->backend;
  for (size_t i = 0; rc == CP_OK && i < ns; i++) {
    rc = cp_streams_event_acquire_locked(&pool->streams, &events[i]);
    if (rc != CP_OK) break;
    made = i + 1;
    rc = be->event_record(be->ctx, events[i], streams[i]);
  }
  if (rc == CP_OK) {
    pthread_mutex_unlock(&pool->lock);
    for (size_t i = 0; i < ns && rc == CP_OK; i++) rc = be->event_synchronize(be->ctx, events[i]);
    pthread_mutex_lock(&pool->lock);
  }
  for (size_t i = 0; i < made; i++) cp_streams_event_release_locked(&pool->streams, events[i]);
  free(events);
  free(streams);
  return rc;
}

/* ------------------------------------------------------------------------------------------
 * Pause, step 4: backups
 * ---------------------------------------------------------------------------------------- */

typedef struct cp_pause_copy_s {
  cp_stream_state_t *st;
  cp_backup_t backup;
} cp_pause_copy_t;

static int cp_pause_add_copy(cp_pause_copy_t **list, size_t *n, size_t *cap, cp_stream_state_t *st,
                             const cp_block_t *b) {
  if ((b->state != CP_BLOCK_LIVE && b->state != CP_BLOCK_PENDING) || b->requested == 0) return CP_OK;
  int rc = cp_pause_grow((void **)list, cap, *n + 1, sizeof **list);
  if (rc == CP_OK) (*list)[(*n)++] = (cp_pause_copy_t){st, {b->addr, b->requested, NULL}};
  return rc;
}

static void cp_pause_free_copies(const cp_backend_t *be, cp_pause_copy_t *copies, size_t n) {
  for (size_t i = 0; i < n; i++) {
    if (copies[i].backup.host != NULL) (void)be->host_free(be->ctx, copies[i].backup.host);
  }
  free(copies);
}

/* Copy the live blocks of the states to host memory (lock dropped), filed on their states. */
static int cp_pause_backup_locked(cp_pool_t *pool, cp_stream_state_t *const *sts, size_t n) {
  cp_pause_copy_t *copies = NULL;
  size_t nc = 0, cap = 0;
  int rc = CP_OK;
  for (const cp_segment_t *seg = pool->segments; seg != NULL && rc == CP_OK; seg = seg->next) {
    if (!seg->paged || !cp_pause_in(sts, n, seg->stream)) continue;
    for (const cp_block_t *b = seg->head; b != NULL && rc == CP_OK; b = b->next)
      rc = cp_pause_add_copy(&copies, &nc, &cap, seg->stream, b);
  }
  for (const cp_segment_t *s = pool->stitched; s != NULL && rc == CP_OK; s = s->next) {
    if (cp_pause_in(sts, n, s->stream)) rc = cp_pause_add_copy(&copies, &nc, &cap, s->stream, s->head);
  }
  const cp_backend_t *be = &pool->backend;
  if (rc == CP_OK && nc != 0) {
    pthread_mutex_unlock(&pool->lock);
    for (size_t i = 0; i < nc && rc == CP_OK; i++) {
      cp_backup_t *bk = &copies[i].backup;
      rc = be->host_alloc(be->ctx, bk->size, &bk->host);
      if (rc != CP_OK) {
        bk->host = NULL;
        break;
      }
      rc = be->copy_to_host(be->ctx, bk->host, bk->addr, bk->size);
    }
    pthread_mutex_lock(&pool->lock);
  }
  /* File them: each state's array grows by its own copies. */
  for (size_t i = 0; i < n && rc == CP_OK; i++) {
    size_t mine = 0;
    for (size_t k = 0; k < nc; k++) mine += copies[k].st == sts[i];
    if (mine == 0) continue;
    cp_backup_t *grown = realloc(sts[i]->backups, (sts[i]->backup_count + mine) * sizeof *grown);
    if (grown == NULL) {
      rc = cp_set_error(CP_ERR_HOST_OOM, "cudapool: no host memory for a region's backups");
      break;
    }
    sts[i]->backups = grown;
  }
  if (rc != CP_OK) {
    pthread_mutex_unlock(&pool->lock);
    cp_pause_free_copies(be, copies, nc);
    pthread_mutex_lock(&pool->lock);
    return rc;
  }
  for (size_t k = 0; k < nc; k++) {
    cp_stream_state_t *st = copies[k].st;
    st->backups[st->backup_count++] = copies[k].backup;
    st->backup_bytes += copies[k].backup.size;
    pool->backup_bytes += copies[k].backup.size;
  }
  free(copies);
  return CP_OK;
}

/* ------------------------------------------------------------------------------------------
 * Pause, step 5: unmap
 * ---------------------------------------------------------------------------------------- */

/* What one unmap gives back: a stitched range (seg->stitched) or a stretch of a segment. */
typedef struct cp_pause_unmap_s {
  cp_segment_t *seg;
  uintptr_t addr;
  size_t size;
  size_t first_handle, handles; /* a stretch: its kept handles, handles[first_handle ..] */
  bool done;
} cp_pause_unmap_t;

/* Every stitched range of the states that is mapped, then every maximal stretch of mapped
 * blocks of their segments. */
static int cp_pause_list_unmaps_locked(cp_pool_t *pool, cp_stream_state_t *const *sts, size_t n, cp_pause_unmap_t **out,
                                       size_t *out_n, size_t *out_ranges) {
  cp_pause_unmap_t *list = NULL;
  size_t k = 0, cap = 0;
  int rc = CP_OK;
  for (cp_segment_t *s = pool->stitched; s != NULL && rc == CP_OK; s = s->next) {
    if (!cp_pause_in(sts, n, s->stream) || s->mapped == 0) continue;
    rc = cp_pause_grow((void **)&list, &cap, k + 1, sizeof *list);
    if (rc == CP_OK) list[k++] = (cp_pause_unmap_t){.seg = s, .addr = s->addr, .size = s->mapped};
  }
  *out_ranges = k;
  for (cp_segment_t *seg = pool->segments; seg != NULL && rc == CP_OK; seg = seg->next) {
    if (!seg->paged || !cp_pause_in(sts, n, seg->stream)) continue;
    for (const cp_block_t *b = seg->head; b != NULL && rc == CP_OK;) {
      if (b->state == CP_BLOCK_UNMAPPED) {
        b = b->next;
        continue;
      }
      const uintptr_t start = b->addr;
      size_t len = 0;
      for (; b != NULL && b->state != CP_BLOCK_UNMAPPED; b = b->next) len += b->size;
      if (cp_expand_paused_span(seg, start, len)) continue; /* held by an earlier pause: none */
      rc = cp_pause_grow((void **)&list, &cap, k + 1, sizeof *list);
      if (rc == CP_OK) list[k++] = (cp_pause_unmap_t){.seg = seg, .addr = start, .size = len};
    }
  }
  if (rc != CP_OK) {
    free(list);
    return rc;
  }
  *out = list;
  *out_n = k;
  return CP_OK;
}

/* pause.h */
int cp_pause_unmap_twice(const cp_backend_t *be, uintptr_t addr, size_t size) {
  int rc = be->page_unmap(be->ctx, addr, size);
  if (rc != CP_OK) rc = be->page_unmap(be->ctx, addr, size);
  return rc;
}

/* Map stitched range `s` again from its segments' kept handles (the undo of its unmap); page_map
 * calls are added to *maps. */
static int cp_pause_remap_range(const cp_backend_t *be, const cp_segment_t *s, size_t *maps) {
  size_t off = 0;
  int rc = CP_OK;
  for (size_t i = 0; i < s->run_count && rc == CP_OK; i++) {
    const cp_stitch_run_t *r = &s->runs[i];
    for (uintptr_t a = r->addr, e; a < r->addr + r->size && rc == CP_OK; a = e) {
      e = cp_expand_edge_up(r->seg, a + r->seg->chunk);
      rc = be->page_map(be->ctx, s->addr + off, e - a, r->seg->pages[(a - r->seg->addr) / r->seg->chunk]);
      ++*maps;
      off += e - a;
    }
  }
  if (rc == CP_OK) rc = be->page_set_access(be->ctx, s->addr, off);
  return rc;
}

/* The kept handles of [addr, addr + size) of `seg` (each once), appended to *list. */
static int cp_pause_add_handles(const cp_segment_t *seg, uintptr_t addr, size_t size, cp_page_t **list, size_t *n,
                                size_t *cap) {
  int rc = CP_OK;
  for (uintptr_t a = addr; a < addr + size && rc == CP_OK; a += seg->chunk) {
    const size_t slot = (a - seg->addr) / seg->chunk;
    if (slot >= seg->page_slots || seg->pages[slot] == 0) continue;
    if (slot != 0 && a != addr && seg->pages[slot - 1] == seg->pages[slot]) continue;
    rc = cp_pause_grow((void **)list, cap, *n + 1, sizeof **list);
    if (rc == CP_OK) (*list)[(*n)++] = seg->pages[slot];
  }
  return rc;
}

static int cp_pause_unmap_locked(cp_pool_t *pool, cp_stream_state_t *const *sts, size_t n) {
  cp_pause_unmap_t *list = NULL;
  size_t k = 0, ranges = 0;
  int rc = cp_pause_list_unmaps_locked(pool, sts, n, &list, &k, &ranges);
  if (rc != CP_OK) return rc;
  /* Room, before anything is unmapped, for the spans and for the handles to release. */
  cp_page_t *handles = NULL;
  size_t nh = 0, hcap = 0;
  for (size_t i = ranges; i < k && rc == CP_OK; i++) {
    cp_segment_t *seg = list[i].seg;
    rc = cp_pause_grow((void **)&seg->spans, &seg->span_cap, seg->span_count + (k - i), sizeof *seg->spans);
    list[i].first_handle = nh;
    if (rc == CP_OK) rc = cp_pause_add_handles(seg, list[i].addr, list[i].size, &handles, &nh, &hcap);
    list[i].handles = nh - list[i].first_handle;
  }
  if (rc != CP_OK) {
    free(list);
    free(handles);
    return rc == CP_ERR_HOST_OOM ? cp_set_error(rc, "cudapool: no host memory to pause a region") : rc;
  }

  const cp_backend_t *be = &pool->backend;
  pthread_mutex_unlock(&pool->lock);
  size_t calls = 0, maps = 0, failed = 0, failed_bytes = 0;
  bool undone = false;
  char why[512] = "";
  for (size_t i = 0; i < k; i++) {
    list[i].done = cp_pause_unmap_twice(be, list[i].addr, list[i].size) == CP_OK;
    calls++;
    if (list[i].done) continue;
    snprintf(why, sizeof why, "%s", cp_last_error());
    if (i <= ranges) {
      /* Nothing given back yet (the segments still map every page a range maps): undo the
       * ranges and leave the region as it was. */
      for (size_t j = 0; j < i; j++) {
        if (list[j].done && cp_pause_remap_range(be, list[j].seg, &maps) == CP_OK) list[j].done = false;
      }
      undone = true;
      break;
    }
    failed++;
    failed_bytes += list[i].size;
  }
  if (!undone) {
    /* One release per handle of a stretch given back (the range mappings are gone too). */
    for (size_t i = ranges; i < k; i++) {
      for (size_t h = 0; list[i].done && h < list[i].handles; h++)
        (void)be->page_release(be->ctx, handles[list[i].first_handle + h]);
    }
  }
  pthread_mutex_lock(&pool->lock);
  pool->device_unmaps += calls;
  pool->device_maps += maps;
  if (undone) {
    rc = cp_set_error(CP_ERR_BACKEND, "cudapool: pause: %s; nothing was paused", why);
    for (size_t j = 0; j < ranges; j++) {
      if (list[j].done) { /* could not be mapped again: left idle-unmapped, never serving */
        list[j].seg->mapped = 0;
        list[j].seg->broken = true;
      }
    }
  } else {
    for (size_t i = 0; i < k; i++) {
      cp_segment_t *seg = list[i].seg;
      if (!list[i].done) continue;
      if (i < ranges) {
        seg->mapped = 0;
        seg->paused_range = true;
        continue;
      }
      seg->spans[seg->span_count++] = (cp_span_t){list[i].addr, list[i].size}; /* room was made above */
      seg->paused += list[i].size;
      seg->stream->paused_bytes += list[i].size;
      pool->paused_bytes += list[i].size;
      cp_stats_dec(&pool->stats, CP_STAT_RESERVED_BYTES, seg->kind, list[i].size);
      pool->stats.num_device_free++;
      CP_SEGMENT_EVENT(pool, CP_HIST_SEGMENT_UNMAP, list[i].addr, list[i].size, seg->stream->handle);
      for (uintptr_t a = list[i].addr; a < list[i].addr + list[i].size; a += seg->chunk) {
        const size_t slot = (a - seg->addr) / seg->chunk;
        if (slot < seg->page_slots) seg->pages[slot] = 0;
      }
    }
    if (failed != 0) {
      rc = cp_set_error(CP_ERR_BACKEND,
                        "cudapool: pause: the device refused to unmap %zu stretch(es) of %zu bytes in all (%s); they "
                        "stay mapped and reserved, the rest of the region is paused",
                        failed, failed_bytes, why);
    }
  }
  free(handles);
  free(list);
  return rc;
}

/* A live block of the states' segments that another process maps (Note [Sharing a block] in
 * share.c), or NULL: pausing would unmap memory that process still holds, and free nothing. */
static const cp_block_t *cp_pause_shared_locked(const cp_pool_t *pool, cp_stream_state_t *const *sts, size_t n) {
  for (size_t pass = 0; pass < 2; pass++) {
    for (const cp_segment_t *seg = pass == 0 ? pool->segments : pool->stitched; seg != NULL; seg = seg->next) {
      bool ours = false;
      for (size_t i = 0; i < n && !ours; i++) ours = seg->stream == sts[i];
      for (const cp_block_t *b = ours ? seg->head : NULL; b != NULL; b = b->next) {
        if (b->state == CP_BLOCK_LIVE && b->shared) return b;
      }
    }
  }
  return NULL;
}

int cp_pool_pause(cp_pool_t *pool, uint32_t tag, unsigned flags) {
  if (pool == NULL) return cp_set_error(CP_ERR_INVALID, "cp_pool_pause: NULL pool");
  if (flags & ~(unsigned)(CP_PAUSE_BACKUP | CP_PAUSE_KEEP_FREE))
    return cp_set_error(CP_ERR_INVALID, "cp_pool_pause: unknown flags 0x%x", flags);
  const bool backup = (flags & CP_PAUSE_BACKUP) != 0;
  pthread_mutex_lock(&pool->lock);
  int rc = cp_pause_refuse_locked(pool, "pause");
  if (rc == CP_OK && backup && pool->backend.copy_to_host == NULL) {
    rc = cp_set_error(CP_ERR_INVALID, "pause: backup=True needs copies to host memory, which the %s device lacks",
                      pool->backend.name);
  }
  cp_stream_state_t **sts = NULL;
  size_t n = 0;
  if (rc == CP_OK) rc = cp_pause_take_states_locked(pool, tag, false, &sts, &n);
  const cp_block_t *shared = rc == CP_OK && n != 0 ? cp_pause_shared_locked(pool, sts, n) : NULL;
  if (shared != NULL) {
    const char *name = cp_region_name(tag);
    rc = cp_set_error(CP_ERR_STATE,
                      "pause: region \"%s\" holds memory shared with another process (%p, %zu bytes, through "
                      "CUDA IPC): pausing would unmap it here while that process still maps it, and free nothing; "
                      "pause once the tensor is freed (after every receiver let it go)",
                      name != NULL ? name : "?", (void *)shared->addr, shared->requested);
    cp_pause_put_states_locked(sts, n);
  }
  if (rc != CP_OK || n == 0) {
    pthread_mutex_unlock(&pool->lock);
    return rc;
  }
  for (size_t i = 0; i < n; i++) sts[i]->paused = true; /* 1. */
  cp_pause_settle_locked(pool, sts, n);
  rc = cp_pause_wait_locked(pool, sts, n); /* 2. */
  if (rc == CP_OK) {
    (void)cp_reclaim_completed_locked(pool);
    for (size_t i = 0; i < n; i++) { /* 3. what stays is paused */
      if (!(flags & CP_PAUSE_KEEP_FREE)) {
        (void)cp_drain_release_now_locked(pool, sts[i]);
      } else if (sts[i]->draining) {
        cp_drain_revive_locked(pool, sts[i]); /* kept: it is paused, and mapped again, whole */
      }
    }
    if (backup) rc = cp_pause_backup_locked(pool, sts, n); /* 4. */
  }
  if (rc == CP_OK) rc = cp_pause_unmap_locked(pool, sts, n); /* 5. */
  for (size_t i = 0; i < n; i++) {
    /* Paused when anything of it was given back (or it has nothing to give); else as it was. */
    bool any = sts[i]->paused_bytes != 0;
    for (const cp_segment_t *s = pool->stitched; s != NULL && !any; s = s->next)
      any = s->stream == sts[i] && s->paused_range;
    if (rc != CP_OK && !any) {
      sts[i]->paused = false;
      cp_pause_drop_backups_locked(pool, sts[i]);
    }
  }
  cp_pause_put_states_locked(sts, n);
  CP_DEBUG_CHECK(pool, "cp_pool_pause");
  pthread_mutex_unlock(&pool->lock);
  return rc;
}
