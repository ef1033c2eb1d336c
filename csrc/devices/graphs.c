/* graphs.c — private pools for CUDA graphs and MemPool ids (Note [Graph pools] in graphs.h).
 * Owns: the private pools, the open allocate-to-pool windows, routing into them, and their
 * release. */
#include "devices/graphs.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "base/fork.h"
#include "devices/devices.h"

typedef struct cpd_gpool_s {
  int device;
  unsigned long long id0, id1;
  cp_pool_t *pool;
  unsigned uses; /* begins not released yet */
  uint32_t tag;  /* Note [Graph regions] */
  unsigned held; /* cpd_graph_pause / resume / restore at work on it without the lock */
  struct cpd_gpool_s *next;
} cpd_gpool_t;

typedef struct cpd_window_s {
  int device;
  cpd_gpool_t *gp;
  cpd_filter_fn filter;
  void *ctx;
  cpd_filter_free_fn free_ctx;
  struct cpd_window_s *next;
} cpd_window_t;

/* Note [Graph lock]
 * One mutex guards both lists. It is outer to every pool lock (allocations and frees of
 * private pools run under it, so a pool cannot be destroyed under them) and inner to the
 * device table's lock: the table is never entered with it held (cpd_pool and cpd_config are
 * called before taking it), and cpd_shutdown takes it with the table's held. `open[d]` and
 * `pool_count` are written under it and read without it on the allocation and free paths. */
static pthread_mutex_t cpd_graph_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t cpd_graph_once = PTHREAD_ONCE_INIT;
static cpd_gpool_t *cpd_gpools;      /* oldest first */
static cpd_window_t *cpd_windows;    /* oldest first */
atomic_int cpd_open[CP_MAX_DEVICES]; /* windows open per device (graphs.h) */
static atomic_int cpd_pool_total;

static void cpd_graph_first_use(void);

static void cpd_graph_lock_take(void) {
  pthread_once(&cpd_graph_once, cpd_graph_first_use);
  pthread_mutex_lock(&cpd_graph_lock);
}

static void cpd_graph_unlock(void) { pthread_mutex_unlock(&cpd_graph_lock); }

static int cpd_check_device(int device, const char *who) {
  if (device < 0 || device >= CP_MAX_DEVICES) {
    return cp_set_error(CP_ERR_INVALID, "cudapool: %s: invalid device %d", who, device);
  }
  return CP_OK;
}

static cpd_gpool_t *cpd_gpool_find_locked(int device, unsigned long long id0, unsigned long long id1) {
  for (cpd_gpool_t *gp = cpd_gpools; gp != NULL; gp = gp->next) {
    if (gp->device == device && gp->id0 == id0 && gp->id1 == id1) return gp;
  }
  return NULL;
}

static int cpd_window_open_on_locked(const cpd_gpool_t *gp) {
  for (cpd_window_t *w = cpd_windows; w != NULL; w = w->next) {
    if (w->gp == gp) return 1;
  }
  return 0;
}

/* Destroy `gp` when nothing holds it any more (Note [Graph pools]); returns the status of
 * emptying it (the pool stays when that fails). */
static int cpd_gpool_maybe_destroy_locked(cpd_gpool_t *gp) {
  if (gp->uses != 0 || gp->held != 0 || atomic_load_explicit(&cpd_open[gp->device], memory_order_relaxed) != 0)
    return CP_OK;
  size_t allocated = 0, reserved = 0;
  cp_pool_usage(gp->pool, &allocated, &reserved);
  if (allocated != 0) return CP_OK;
  /* Wait for pending frees (their streams may still use the memory), give it all back. */
  int rc = cp_empty_cache(gp->pool);
  if (rc != CP_OK) return rc;
  cpd_gpool_t **link = &cpd_gpools;
  while (*link != gp) link = &(*link)->next;
  *link = gp->next;
  cp_pool_destroy(gp->pool);
  free(gp);
  atomic_fetch_sub_explicit(&cpd_pool_total, 1, memory_order_relaxed);
  return CP_OK;
}

/* Open (delta +1) or close (-1) a capture window on the shared pool and every private pool of
 * `device`. */
static void cpd_device_windows_locked(int device, cp_pool_t *shared, int delta) {
  if (shared != NULL) (void)(delta > 0 ? cp_pool_capture_begin(shared) : cp_pool_capture_end(shared));
  for (cpd_gpool_t *gp = cpd_gpools; gp != NULL; gp = gp->next) {
    if (gp->device == device) (void)(delta > 0 ? cp_pool_capture_begin(gp->pool) : cp_pool_capture_end(gp->pool));
  }
}

/* A new private pool of (device, id), on the list with no use yet; `shared` is the device's
 * pool (its backend serves the new one). Graph lock held; the table was entered before. */
static int cpd_gpool_create_locked(int device, unsigned long long id0, unsigned long long id1, cp_pool_t *shared,
                                   cpd_gpool_t **out_gp) {
  cp_config_t cfg;
  cpd_config(&cfg);
  /* A graph's pool keeps its plain segments, as torch's does: page_stitching alone would turn
   * paging on, and nothing a captured graph uses may be unmapped or stitched elsewhere. In a
   * region it is page-mapped, so that a pause can give it back (Note [Graph regions]). */
  const uint32_t tag = cp_region_of_thread();
  cfg.expandable_segments = tag != 0;
  cfg.page_stitching = 0;
  cpd_gpool_t *gp = calloc(1, sizeof *gp);
  if (gp == NULL) return cp_set_error(CP_ERR_HOST_OOM, "cudapool: no host memory for a private pool");
  cp_backend_t backend;
  cp_pool_backend(shared, &backend);
  int rc = cp_pool_create(&cfg, &backend, &gp->pool);
  if (rc != CP_OK) {
    free(gp);
    return rc;
  }
  gp->device = device;
  gp->id0 = id0;
  gp->id1 = id1;
  gp->tag = tag;
  cpd_observe_pool(gp->pool, device);
  cpd_gpool_t **link = &cpd_gpools;
  while (*link != NULL) link = &(*link)->next;
  *link = gp;
  atomic_fetch_add_explicit(&cpd_pool_total, 1, memory_order_relaxed);
  /* Windows already open on the device cover the new pool too. */
  for (int k = atomic_load_explicit(&cpd_open[device], memory_order_relaxed); k > 0; k--) {
    cp_pool_capture_begin(gp->pool);
  }
  *out_gp = gp;
  return CP_OK;
}

int cpd_graph_begin(int device, unsigned long long id0, unsigned long long id1, cpd_filter_fn filter, void *ctx,
                    cpd_filter_free_fn free_ctx) {
  int rc = cpd_check_device(device, "begin_allocate_to_pool");
  if (rc == CP_OK && filter == NULL) rc = cp_set_error(CP_ERR_INVALID, "cudapool: begin_allocate_to_pool: no filter");
  /* The table is entered before the graph lock (Note [Graph lock]). */
  cp_pool_t *shared = NULL;
  if (rc == CP_OK) rc = cpd_pool(device, &shared);
  cpd_window_t *w = rc == CP_OK ? calloc(1, sizeof *w) : NULL;
  if (rc == CP_OK && w == NULL) rc = cp_set_error(CP_ERR_HOST_OOM, "cudapool: begin_allocate_to_pool: no host memory");
  if (rc != CP_OK) {
    if (free_ctx != NULL) free_ctx(ctx);
    return rc;
  }
  cpd_graph_lock_take();
  cpd_gpool_t *gp = cpd_gpool_find_locked(device, id0, id1);
  if (gp != NULL && cpd_window_open_on_locked(gp)) {
    rc = cp_set_error(CP_ERR_STATE,
                      "cudapool: begin_allocate_to_pool: device %d is already allocating to pool (%llu, %llu)", device,
                      id0, id1);
  } else if (gp == NULL) {
    rc = cpd_gpool_create_locked(device, id0, id1, shared, &gp);
  }
  if (rc == CP_OK) {
    gp->uses++;
    *w = (cpd_window_t){device, gp, filter, ctx, free_ctx, NULL};
    cpd_window_t **link = &cpd_windows;
    while (*link != NULL) link = &(*link)->next;
    *link = w;
    atomic_fetch_add_explicit(&cpd_open[device], 1, memory_order_relaxed);
    cpd_device_windows_locked(device, shared, +1);
  }
  cpd_graph_unlock();
  if (rc != CP_OK) {
    free(w);
    if (free_ctx != NULL) free_ctx(ctx);
  }
  return rc;
}

int cpd_graph_end(int device, unsigned long long id0, unsigned long long id1) {
  int rc = cpd_check_device(device, "end_allocate_to_pool");
  if (rc != CP_OK) return rc;
  cp_pool_t *shared = cpd_pool_if_created(device);
  cpd_window_t *closed = NULL;
  cpd_graph_lock_take();
  for (cpd_window_t **link = &cpd_windows; *link != NULL; link = &(*link)->next) {
    cpd_window_t *w = *link;
    if (w->device == device && w->gp->id0 == id0 && w->gp->id1 == id1) {
      *link = w->next;
      closed = w;
      break;
    }
  }
  if (closed == NULL) {
    rc = cp_set_error(CP_ERR_STATE, "cudapool: end_allocate_to_pool: device %d is not allocating to pool (%llu, %llu)",
                      device, id0, id1);
  } else {
    cpd_device_windows_locked(device, shared, -1);
    atomic_fetch_sub_explicit(&cpd_open[device], 1, memory_order_relaxed);
    if (atomic_load_explicit(&cpd_open[device], memory_order_relaxed) == 0) {
      /* Pools released while the device was capturing can go now. */
      for (cpd_gpool_t *gp = cpd_gpools, *next; gp != NULL; gp = next) {
        next = gp->next;
        if (gp->device == device) (void)cpd_gpool_maybe_destroy_locked(gp);
      }
    }
  }
  cpd_graph_unlock();
  if (closed != NULL) {
    if (closed->free_ctx != NULL) closed->free_ctx(closed->ctx);
    free(closed);
  }
  return rc;
}

int cpd_graph_release(int device, unsigned long long id0, unsigned long long id1) {
  int rc = cpd_check_device(device, "release_pool");
  if (rc != CP_OK) return rc;
  cpd_graph_lock_take();
  cpd_gpool_t *gp = cpd_gpool_find_locked(device, id0, id1);
  if (gp == NULL || gp->uses == 0) {
    rc = cp_set_error(CP_ERR_STATE, "cudapool: release_pool: device %d has no pool (%llu, %llu) in use", device, id0,
                      id1);
  } else {
    gp->uses--;
    rc = cpd_gpool_maybe_destroy_locked(gp);
  }
  cpd_graph_unlock();
  return rc;
}

int cpd_graph_incref(int device, unsigned long long id0, unsigned long long id1) {
  int rc = cpd_check_device(device, "createOrIncrefPool");
  cp_pool_t *shared = NULL;
  if (rc == CP_OK) rc = cpd_pool(device, &shared); /* the table before the graph lock */
  if (rc != CP_OK) return rc;
  cpd_graph_lock_take();
  cpd_gpool_t *gp = cpd_gpool_find_locked(device, id0, id1);
  if (gp == NULL) rc = cpd_gpool_create_locked(device, id0, id1, shared, &gp);
  if (rc == CP_OK) gp->uses++;
  cpd_graph_unlock();
  return rc;
}

unsigned cpd_graph_use_count(int device, unsigned long long id0, unsigned long long id1) {
  cpd_graph_lock_take();
  const cpd_gpool_t *gp = cpd_gpool_find_locked(device, id0, id1);
  const unsigned uses = gp != NULL ? gp->uses : 0;
  cpd_graph_unlock();
  return uses;
}

int cpd_graph_empty(unsigned long long id0, unsigned long long id1) {
  int first = CP_OK;
  cpd_graph_lock_take();
  for (cpd_gpool_t *gp = cpd_gpools, *next; gp != NULL; gp = next) {
    next = gp->next;
    if (gp->id0 != id0 || gp->id1 != id1) continue;
    int rc = cp_empty_cache(gp->pool);
    if (rc == CP_OK) rc = cpd_gpool_maybe_destroy_locked(gp);
    if (rc != CP_OK && first == CP_OK) first = rc;
  }
  cpd_graph_unlock();
  return first;
}

int cpd_graph_visit(cpd_graph_visit_fn fn, void *arg) {
  int rc = CP_OK;
  cpd_graph_lock_take();
  for (cpd_gpool_t *gp = cpd_gpools; gp != NULL && rc == CP_OK; gp = gp->next) {
    rc = fn(arg, gp->device, gp->id0, gp->id1, gp->pool);
  }
  cpd_graph_unlock();
  return rc;
}

int cpd_graph_alloc(size_t size, int device, void *stream, void **out_ptr, int *out_routed) {
  *out_routed = 0;
  if (device < 0 || device >= CP_MAX_DEVICES || atomic_load_explicit(&cpd_open[device], memory_order_relaxed) == 0) {
    return CP_OK;
  }
  int rc = CP_OK;
  cpd_graph_lock_take();
  for (cpd_window_t *w = cpd_windows; w != NULL; w = w->next) {
    if (w->device == device && w->filter(w->ctx, stream)) {
      *out_routed = 1;
      rc = cp_alloc_in(w->gp->pool, size, (cp_stream_t)stream, w->gp->tag, out_ptr);
      break;
    }
  }
  cpd_graph_unlock();
  return rc;
}

/* Take hold of the pool of (device, id) (CP_ERR_INVALID when there is none), so that it stays
 * while used without the graph lock; cpd_gpool_put lets it go. */
static int cpd_gpool_get(int device, unsigned long long id0, unsigned long long id1, const char *who,
                         cpd_gpool_t **out_gp) {
  int rc = cpd_check_device(device, who);
  if (rc != CP_OK) return rc;
  cpd_graph_lock_take();
  cpd_gpool_t *gp = cpd_gpool_find_locked(device, id0, id1);
  if (gp == NULL) {
    rc =
        cp_set_error(CP_ERR_INVALID, "cudapool: %s: device %d has no private pool (%llu, %llu)", who, device, id0, id1);
  } else {
    gp->held++;
  }
  cpd_graph_unlock();
  *out_gp = gp;
  return rc;
}

static void cpd_gpool_put(cpd_gpool_t *gp) {
  cpd_graph_lock_take();
  gp->held--;
  (void)cpd_gpool_maybe_destroy_locked(gp);
  cpd_graph_unlock();
}

int cpd_graph_checkpoint(int device, unsigned long long id0, unsigned long long id1, cp_checkpoint_t **out_ck) {
  cpd_gpool_t *gp = NULL;
  int rc = cpd_gpool_get(device, id0, id1, "getCheckpointState", &gp);
  if (rc != CP_OK) return rc;
  rc = cp_pool_checkpoint(gp->pool, out_ck);
  cpd_gpool_put(gp);
  return rc;
}

int cpd_graph_restore(int device, unsigned long long id0, unsigned long long id1, const cp_checkpoint_t *ck,
                      cp_restore_t *out) {
  cpd_gpool_t *gp = NULL;
  int rc = cpd_gpool_get(device, id0, id1, "setCheckpointPoolState", &gp);
  if (rc != CP_OK) return rc;
  rc = cp_pool_restore(gp->pool, ck, out);
  cpd_gpool_put(gp);
  return rc;
}

int cpd_graph_live_blocks(int device, unsigned long long id0, unsigned long long id1, void ***out_ptrs,
                          size_t *out_count) {
  cpd_gpool_t *gp = NULL;
  int rc = cpd_gpool_get(device, id0, id1, "checkPoolLiveAllocations", &gp);
  if (rc != CP_OK) return rc;
  rc = cp_pool_live_blocks(gp->pool, out_ptrs, out_count);
  cpd_gpool_put(gp);
  return rc;
}

int cpd_graph_pools_exist(void) { return atomic_load_explicit(&cpd_pool_total, memory_order_relaxed) != 0; }

/* The private pool holding `ptr` as a live allocation (of `device`'s pools only, unless it is
 * -1), or NULL: the private pools' half of Note [Pointer owners] in devices.h. */
static cpd_gpool_t *cpd_gpool_owner_locked(const void *ptr, int device) {
  for (cpd_gpool_t *gp = cpd_gpools; gp != NULL; gp = gp->next) {
    if ((device < 0 || gp->device == device) && cp_pool_lookup(gp->pool, (void *)ptr, NULL)) return gp;
  }
  return NULL;
}

int cpd_graph_free(void *ptr, const size_t *size, int device, int *out_handled) {
  int rc = CP_OK;
  cpd_graph_lock_take();
  cpd_gpool_t *gp = device >= 0 ? cpd_gpool_owner_locked(ptr, device) : NULL;
  *out_handled = gp != NULL;
  if (gp != NULL) {
    rc = size == NULL ? cp_free(gp->pool, ptr) : cp_free_sized(gp->pool, ptr, *size);
    if (rc == CP_OK) rc = cpd_gpool_maybe_destroy_locked(gp);
  }
  cpd_graph_unlock();
  return rc;
}

int cpd_graph_device_of(const void *ptr, int *out_device) {
  cpd_graph_lock_take();
  const cpd_gpool_t *gp = cpd_gpool_owner_locked(ptr, -1);
  if (gp != NULL) *out_device = gp->device;
  cpd_graph_unlock();
  return gp != NULL;
}

int cpd_graph_record_stream(void *ptr, void *stream, int *out_handled) {
  int rc = CP_OK;
  cpd_graph_lock_take();
  cpd_gpool_t *gp = cpd_gpool_owner_locked(ptr, -1);
  *out_handled = gp != NULL;
  if (gp != NULL) rc = cp_record_stream(gp->pool, ptr, (cp_stream_t)stream);
  cpd_graph_unlock();
  return rc;
}

int cpd_graph_share(void *ptr, cp_share_t *out, int *out_device, cp_backend_t *out_backend, int *out_handled) {
  int rc = CP_OK;
  cpd_graph_lock_take();
  cpd_gpool_t *gp = cpd_gpool_owner_locked(ptr, -1);
  *out_handled = gp != NULL;
  if (gp != NULL) {
    *out_device = gp->device;
    cp_pool_backend(gp->pool, out_backend);
    rc = cp_pool_share(gp->pool, ptr, out);
  }
  cpd_graph_unlock();
  return rc;
}

int cpd_graph_is_shared(const void *ptr) {
  cpd_graph_lock_take();
  const cpd_gpool_t *gp = cpd_gpool_owner_locked(ptr, -1);
  const int shared = gp != NULL && cp_pool_is_shared(gp->pool, ptr);
  cpd_graph_unlock();
  return shared;
}

int cpd_graph_base_of(const void *ptr, void **out_base, size_t *out_size) {
  int kind = CP_PTR_FOREIGN;
  cpd_graph_lock_take();
  for (cpd_gpool_t *gp = cpd_gpools; gp != NULL && kind == CP_PTR_FOREIGN; gp = gp->next) {
    kind = cp_pool_base_of(gp->pool, ptr, out_base, out_size);
  }
  cpd_graph_unlock();
  return kind;
}

int cpd_graph_collect(void) {
  int first = CP_OK;
  cpd_graph_lock_take();
  for (cpd_gpool_t *gp = cpd_gpools, *next; gp != NULL; gp = next) {
    next = gp->next;
    int rc = cpd_gpool_maybe_destroy_locked(gp);
    if (rc != CP_OK && first == CP_OK) first = rc;
  }
  cpd_graph_unlock();
  return first;
}

size_t cpd_graph_pools(cpd_graph_info_t *out, size_t max) {
  size_t n = 0;
  cpd_graph_lock_take();
  for (cpd_gpool_t *gp = cpd_gpools; gp != NULL; gp = gp->next, n++) {
    if (n >= max) continue;
    cp_stats_t stats;
    cp_pool_stats(gp->pool, &stats);
    cpd_graph_info_t *info = &out[n];
    info->device = gp->device;
    info->id0 = gp->id0;
    info->id1 = gp->id1;
    info->uses = gp->uses;
    info->window_open = cpd_window_open_on_locked(gp);
    cp_pool_usage(gp->pool, &info->allocated, &info->reserved);
    info->allocations = (size_t)stats.family[CP_STAT_ALLOCATION][CP_KIND_ALL].current;
    info->tag = gp->tag;
    cp_pool_info_t pi;
    cp_pool_info(gp->pool, &pi);
    info->paused = pi.paused_bytes;
  }
  cpd_graph_unlock();
  return n;
}

cp_pool_t *cpd_graph_pool(int device, unsigned long long id0, unsigned long long id1) {
  cpd_graph_lock_take();
  cpd_gpool_t *gp = cpd_gpool_find_locked(device, id0, id1);
  cp_pool_t *pool = gp != NULL ? gp->pool : NULL;
  cpd_graph_unlock();
  return pool;
}

/* Pause (pause != 0) or resume the private pools of region `tag` on `device`. */
static int cpd_graph_pause_resume(int device, uint32_t tag, int pause, unsigned flags) {
  int rc = cpd_check_device(device, pause ? "pause" : "resume");
  if (rc != CP_OK) return rc;
  cpd_graph_lock_take();
  size_t n = 0;
  for (cpd_gpool_t *gp = cpd_gpools; gp != NULL; gp = gp->next) n += gp->device == device && gp->tag != 0;
  cpd_gpool_t **held = n != 0 ? malloc(n * sizeof *held) : NULL;
  if (n != 0 && held == NULL) {
    cpd_graph_unlock();
    return cp_set_error(CP_ERR_HOST_OOM, "cudapool: no host memory to pause graph pools");
  }
  size_t k = 0;
  for (cpd_gpool_t *gp = cpd_gpools; gp != NULL; gp = gp->next) {
    if (gp->device != device || gp->tag == 0 || (tag != 0 && gp->tag != tag)) continue;
    gp->held++;
    held[k++] = gp;
  }
  cpd_graph_unlock();
  for (size_t i = 0; i < k; i++) { /* the tag is the pool's own: every state of it matches */
    const int r = pause ? cp_pool_pause(held[i]->pool, held[i]->tag, flags) : cp_pool_resume(held[i]->pool, 0);
    if (r != CP_OK && rc == CP_OK) rc = r;
  }
  cpd_graph_lock_take();
  for (size_t i = 0; i < k; i++) {
    held[i]->held--;
    (void)cpd_gpool_maybe_destroy_locked(held[i]);
  }
  cpd_graph_unlock();
  free(held);
  return rc;
}

int cpd_graph_pause(int device, uint32_t tag, int backup) {
  return cpd_graph_pause_resume(device, tag, 1, CP_PAUSE_KEEP_FREE | (backup ? CP_PAUSE_BACKUP : 0u));
}

int cpd_graph_resume(int device, uint32_t tag) { return cpd_graph_pause_resume(device, tag, 0, 0); }

/* Destroy every private pool and close every window (the device table's shutdown). */
static void cpd_graphs_shutdown(void) {
  cpd_graph_lock_take();
  for (cpd_window_t *w = cpd_windows, *next; w != NULL; w = next) {
    next = w->next;
    if (w->free_ctx != NULL) w->free_ctx(w->ctx);
    free(w);
  }
  cpd_windows = NULL;
  for (cpd_gpool_t *gp = cpd_gpools, *next; gp != NULL; gp = next) {
    next = gp->next;
    cp_pool_destroy(gp->pool);
    free(gp);
  }
  cpd_gpools = NULL;
  for (int d = 0; d < CP_MAX_DEVICES; d++) atomic_store_explicit(&cpd_open[d], 0, memory_order_relaxed);
  atomic_store_explicit(&cpd_pool_total, 0, memory_order_relaxed);
  cpd_graph_unlock();
}

static void cpd_graphs_observe(void) {
  cpd_graph_lock_take();
  for (cpd_gpool_t *gp = cpd_gpools; gp != NULL; gp = gp->next) cpd_observe_pool(gp->pool, gp->device);
  cpd_graph_unlock();
}

static const cpd_table_hooks_t cpd_graph_hooks = {NULL, cpd_graphs_shutdown, cpd_graphs_observe};

/* Before the graph lock is first taken, so before any private pool exists: the fork handlers
 * learn the lock, and the device table the hooks by which it reaches the private pools (Note
 * [Hooks of the device table] in devices.h). No lock of the file is held here, so taking the
 * table's (outer to the graph lock) is in order. */
static void cpd_graph_first_use(void) {
  cpd_fork_register_table(); /* the table's lock first: it is the outer one */
  cp_fork_register_outer(&cpd_graph_lock);
  cpd_table_hooks_add(&cpd_graph_hooks);
}
