/* test_cuda_standin_threads.c — many threads on pools over the CUDA backend, against the stand-in
 * for libcuda (make test-c-standin under ASan+UBSan, make test-tsan-standin under TSan).
 * Owns: 8 worker threads on 2 devices with 4 streams each, allocating, freeing, recording
 * streams and launching work, while a driver thread completes work, empties the caches, sets
 * and lifts a cap, makes allocation calls fail now and then, checks the pools, and pauses and
 * resumes a region (with a backup) whose blocks the workers hold. Workers also share blocks for
 * another process, as torch's IPC does (cp_pool_share, then the driver's export: the IPC handle of
 * a plain segment, which this process may not open itself, or a file descriptor per physical
 * allocation of page-mapped memory, imported again and released), the region's blocks included,
 * so that a pause is refused while one of them lives (and a share of a block of the region is
 * refused while the region is paused). Once for each policy: plain segments,
 * expandable segments, cudapool's default policy (page stitching).
 *
 * Overlap shows in a registry of every live block per device (a sorted array under its own
 * lock, taken only around its own update): a block handed out over a live one is an error
 * there, whatever the bytes. Use after unmap shows as a device fault in the stand-in (a launch
 * on memory without access, an unmap under queued work). At the end: no fault, every pool
 * consistent, stats balanced, nothing left on either device, no stream or event left.
 *
 *   test_cuda_standin_threads [--iters N] [--seed N]     (iterations per worker) */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "backend/cuda.h"
#include "check.h"
#include "core/cp.h"
#include "core/share.h"
#include "rand.h"
#include "standin/standin.h"
#include "standin_open.h"

#define KiB ((size_t)1 << 10)
#define MiB ((size_t)1 << 20)

#define DEVICES          2
#define STREAMS          4 /* per device */
#define THREADS          8
#define MAX_LIVE         48
#define CAPACITY         (512 * MiB)
#define CAP_WHILE_TIGHT  (160 * MiB)
#define DEFAULT_ITERS    42000
#define REGION_MAX_BYTES (24 * MiB) /* per worker, in the paused region */

static cpstandin_api_t sa;

static void print_faults(void) {
  char text[256];
  for (size_t i = 0; i < sa.faults() && sa.fault_text(i, text, sizeof text) == 0; i++)
    fprintf(stderr, "  stand-in fault %zu: %s\n", i, text);
}

/* ---- The registry of live blocks ------------------------------------------------------------ */

typedef struct span_s {
  uintptr_t addr;
  size_t size;
} span_t;

typedef struct registry_s {
  pthread_mutex_t lock;
  span_t *spans; /* sorted by addr */
  size_t n, cap;
} registry_t;

static size_t registry_lower(const registry_t *g, uintptr_t addr) { /* the first span at or after addr */
  size_t lo = 0, hi = g->n;
  while (lo < hi) {
    const size_t mid = lo + (hi - lo) / 2;
    if (g->spans[mid].addr < addr)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

/* 0, or -1 when [addr, addr + size) overlaps a live block. */
static int registry_add(registry_t *g, uintptr_t addr, size_t size) {
  pthread_mutex_lock(&g->lock);
  const size_t i = registry_lower(g, addr);
  int overlap =
      (i < g->n && g->spans[i].addr < addr + size) || (i > 0 && g->spans[i - 1].addr + g->spans[i - 1].size > addr);
  if (!overlap && g->n < g->cap) {
    memmove(&g->spans[i + 1], &g->spans[i], (g->n - i) * sizeof g->spans[0]);
    g->spans[i] = (span_t){addr, size};
    g->n++;
  }
  pthread_mutex_unlock(&g->lock);
  return overlap ? -1 : 0;
}

static int registry_remove(registry_t *g, uintptr_t addr) {
  pthread_mutex_lock(&g->lock);
  const size_t i = registry_lower(g, addr);
  const int found = i < g->n && g->spans[i].addr == addr;
  if (found) {
    memmove(&g->spans[i], &g->spans[i + 1], (g->n - i - 1) * sizeof g->spans[0]);
    g->n--;
  }
  pthread_mutex_unlock(&g->lock);
  return found ? 0 : -1;
}

/* ---- Shared state ------------------------------------------------------------------------- */

typedef struct shared_s {
  const char *conf;
  long iters;
  uint64_t seed;
  cp_pool_t *pool[DEVICES];
  cp_backend_t be[DEVICES];
  uintptr_t stream[DEVICES][STREAMS];
  registry_t live[DEVICES];
  uint32_t region;
  /* Workers launch on the region's blocks only while holding this for reading; the driver
   * holds it for writing from a pause to its resume (what a user's code does: paused tensors
   * are not touched). */
  pthread_rwlock_t region_use;
  atomic_int workers_running;
  atomic_long errors, allocs, frees, ooms, records, paused_refusals, region_allocs;
  atomic_long shares, exports, pauses_refused_shared, shares_refused_paused;
} shared_t;

static void worker_error(shared_t *sh, int id, const char *what, const void *ptr, size_t size) {
  atomic_fetch_add(&sh->errors, 1);
  fprintf(stderr, "test_cuda_standin_threads: thread %d: %s (ptr %p, size %zu)\n", id, what, ptr, size);
}

typedef struct live_s {
  void *ptr;
  size_t size;
  int in_region;
} live_t;

typedef struct worker_s {
  shared_t *sh;
  int id;
  pthread_t thread;
} worker_t;

/* Work on [p, p + size) queued on `stream`: its device must have access there, and the memory
 * must stay mapped until the work is completed. Blocks above 1 MiB get it on their first and
 * last 64 KiB only: the stand-in touches every host page of a launch, under TSan the bulk of
 * the run otherwise. */
static int launch(uintptr_t stream, void *p, size_t size) {
  if (size <= MiB) return sa.launch(stream, (uintptr_t)p, size);
  const int rc = sa.launch(stream, (uintptr_t)p, 64 * KiB);
  return rc != 0 ? rc : sa.launch(stream, (uintptr_t)p + size - 64 * KiB, 64 * KiB);
}

/* Mostly small, some of a few MiB, now and then tens of MiB (own segments, many pages). */
static size_t random_size(uint64_t *rs) {
  const uint64_t r = rng_below(rs, 1000);
  if (r < 850) return 1 + (size_t)rng_below(rs, 256 * KiB);
  if (r < 995) return 1 * MiB + (size_t)rng_below(rs, 7 * MiB + 1);
  return 16 * MiB + (size_t)rng_below(rs, 16 * MiB + 1);
}

static void free_one(shared_t *sh, int id, int dev, live_t *l, uint64_t *rs) {
  cp_pool_t *pool = sh->pool[dev];
  if (!l->in_region && rng_below(rs, 6) == 0) { /* also used on another stream of the device */
    const uintptr_t other = sh->stream[dev][rng_below(rs, STREAMS)];
    if (cp_record_stream(pool, l->ptr, other) != CP_OK) worker_error(sh, id, cp_last_error(), l->ptr, l->size);
    if (launch(other, l->ptr, l->size) != 0) worker_error(sh, id, "launch (other)", l->ptr, l->size);
    atomic_fetch_add(&sh->records, 1);
  }
  if (registry_remove(&sh->live[dev], (uintptr_t)l->ptr) != 0)
    worker_error(sh, id, "a live block missing from the registry", l->ptr, l->size);
  if (cp_free(pool, l->ptr) != CP_OK) worker_error(sh, id, cp_last_error(), l->ptr, l->size);
  atomic_fetch_add(&sh->frees, 1);
  l->ptr = NULL;
}

/* Share the live block [p, p + size) for another process: its description must cover exactly
 * the block (a plain segment holding it, or whole handles side by side), and each piece must
 * export. A plain segment's IPC handle is refused to this very process (as the driver refuses
 * it); a page's descriptor imports here as a handle of its own, released again. */
static void share_one(shared_t *sh, int id, int dev, void *p, size_t size, int in_region) {
  cp_share_t d;
  const int rc = cp_pool_share(sh->pool[dev], p, &d);
  if (rc == CP_ERR_STATE && in_region && strstr(cp_last_error(), "is paused") != NULL) {
    atomic_fetch_add(&sh->shares_refused_paused, 1); /* the driver thread paused the region meanwhile */
    cp_clear_error();
    return;
  }
  if (rc != CP_OK) {
    worker_error(sh, id, cp_last_error(), p, size);
    return;
  }
  const cp_backend_t *be = &sh->be[dev];
  if (d.block_bytes != size || d.offset + size > d.size)
    worker_error(sh, id, "share: the block is not covered", p, size);
  if (!d.paged) {
    unsigned char handle[CP_IPC_HANDLE_BYTES];
    uintptr_t opened = 0;
    if (d.base + d.offset != (uintptr_t)p) worker_error(sh, id, "share: not the block's segment", p, size);
    if (be->ipc_export(be->ctx, d.base, handle) != CP_OK)
      worker_error(sh, id, cp_last_error(), p, size);
    else if (be->ipc_open(be->ctx, handle, &opened) == CP_OK)
      worker_error(sh, id, "share: opened in its own process", p, size);
    cp_clear_error();
    atomic_fetch_add(&sh->exports, 1);
  } else {
    uintptr_t at = d.base;
    for (size_t k = 0; k < d.span_count; at += d.spans[k++].size) {
      int fd = -1;
      cp_page_t page = 0;
      if (d.spans[k].addr != at || be->page_export(be->ctx, at, &fd) != CP_OK) {
        worker_error(sh, id, d.spans[k].addr != at ? "share: spans not side by side" : cp_last_error(), p, size);
        break;
      }
      if (be->page_import(be->ctx, fd, &page) != CP_OK || be->page_release(be->ctx, page) != CP_OK)
        worker_error(sh, id, cp_last_error(), p, size);
      close(fd);
      atomic_fetch_add(&sh->exports, 1);
    }
    if (at != d.base + d.size) worker_error(sh, id, "share: the handles do not add up", p, size);
  }
  cp_share_release(&d);
  atomic_fetch_add(&sh->shares, 1);
}

static void *worker_main(void *arg) {
  worker_t *w = arg;
  shared_t *sh = w->sh;
  const int id = w->id, dev = id % DEVICES;
  cp_pool_t *pool = sh->pool[dev];
  uint64_t rs = (sh->seed + 0x9E3779B97F4A7C15ull * (uint64_t)(id + 1)) | 1;
  const uintptr_t own = sh->stream[dev][(id / DEVICES) % STREAMS];
  live_t live[MAX_LIVE];
  int n_live = 0;
  size_t region_bytes = 0;
  /* The device's primary context current on this thread, as torch makes it: the legacy stream
   * (1) is that context's. */
  void *ctx = NULL;
  if (sa.cuDevicePrimaryCtxRetain(&ctx, dev) != 0 || sa.cuCtxSetCurrent(ctx) != 0)
    worker_error(sh, id, "no primary context", NULL, 0);
  for (long it = 0; it < sh->iters; it++) {
    if (n_live == MAX_LIVE || (n_live > 0 && rng_below(&rs, 2) == 0)) {
      const int k = (int)rng_below(&rs, (uint64_t)n_live);
      if (live[k].in_region) region_bytes -= live[k].size;
      free_one(sh, id, dev, &live[k], &rs);
      live[k] = live[--n_live];
      continue;
    }
    const size_t size = random_size(&rs);
    /* Some work on the device's other streams or its legacy stream (1). */
    const uint64_t pick = rng_below(&rs, 16);
    const uintptr_t stream = pick == 0 ? 1 : pick == 1 ? sh->stream[dev][rng_below(&rs, STREAMS)] : own;
    const int in_region = dev == 0 && rng_below(&rs, 8) == 0 && region_bytes + size <= REGION_MAX_BYTES;
    void *p = NULL;
    const int rc = in_region ? cp_alloc_in(pool, size, stream, sh->region, &p) : cp_alloc(pool, size, stream, &p);
    if (rc == CP_ERR_OOM) {
      atomic_fetch_add(&sh->ooms, 1);
      continue;
    }
    if (rc == CP_ERR_STATE && in_region) { /* the region is paused */
      atomic_fetch_add(&sh->paused_refusals, 1);
      continue;
    }
    if (rc != CP_OK || p == NULL || (uintptr_t)p % 512 != 0) {
      worker_error(sh, id, rc != CP_OK ? cp_last_error() : "a bad pointer", p, size);
      continue;
    }
    atomic_fetch_add(&sh->allocs, 1);
    if (in_region) atomic_fetch_add(&sh->region_allocs, 1);
    if (registry_add(&sh->live[dev], (uintptr_t)p, size) != 0) {
      worker_error(sh, id, "handed out over a live block", p, size);
      (void)cp_free(pool, p);
      continue;
    }
    if (!in_region) {
      if (launch(stream, p, size) != 0) worker_error(sh, id, "launch", p, size);
    } else if (pthread_rwlock_tryrdlock(&sh->region_use) == 0) { /* not while it is paused */
      if (launch(stream, p, size) != 0) worker_error(sh, id, "launch (region)", p, size);
      pthread_rwlock_unlock(&sh->region_use);
    }
    if (in_region) region_bytes += size;
    if (rng_below(&rs, in_region ? 64 : 1024) == 0) share_one(sh, id, dev, p, size, in_region);
    live[n_live++] = (live_t){p, size, in_region};
  }
  while (n_live > 0) free_one(sh, id, dev, &live[--n_live], &rs);
  if (sa.cuCtxSetCurrent(NULL) != 0 || sa.cuDevicePrimaryCtxRelease(dev) != 0)
    worker_error(sh, id, "releasing the primary context", NULL, 0);
  atomic_fetch_sub(&sh->workers_running, 1);
  return NULL;
}

/* ---- The driver thread ---------------------------------------------------------------------- */

typedef struct driver_counts_s {
  long ticks, empty_caches, caps, checks, pauses, injected;
} driver_counts_t;

#define OPS_PER_EMPTY_CACHE 3000
#define OPS_PER_CAP_TOGGLE  1700
#define OPS_PER_CHECK       2500
#define OPS_PER_PAUSE       9000
#define OPS_PER_INJECTION   1100

static void driver_loop(shared_t *sh, driver_counts_t *c) {
  uint64_t rs = (sh->seed ^ 0xD1B54A32D192ED03ull) | 1;
  long next_empty = OPS_PER_EMPTY_CACHE, next_cap = OPS_PER_CAP_TOGGLE, next_check = OPS_PER_CHECK;
  long next_pause = OPS_PER_PAUSE, next_injection = OPS_PER_INJECTION;
  int tight = 0;
  const int paged = strstr(sh->conf, "expandable") != NULL;
  while (atomic_load(&sh->workers_running) > 0) {
    const struct timespec ts = {0, 50 * 1000};
    nanosleep(&ts, NULL);
    c->ticks++;
    const uint64_t r = rng_below(&rs, 100);
    if (r < 50)
      sa.complete_all();
    else if (r < 90)
      (void)sa.complete(sh->stream[rng_below(&rs, DEVICES)][rng_below(&rs, STREAMS)]);
    const long done = atomic_load(&sh->allocs) + atomic_load(&sh->frees) + atomic_load(&sh->ooms);
    const int dev = (int)rng_below(&rs, DEVICES);
    if (done >= next_empty) {
      next_empty = done + OPS_PER_EMPTY_CACHE;
      if (cp_empty_cache(sh->pool[dev]) != CP_OK) worker_error(sh, -1, cp_last_error(), NULL, 0);
      c->empty_caches++;
    }
    if (done >= next_cap) {
      next_cap = done + OPS_PER_CAP_TOGGLE;
      tight = !tight;
      for (int d = 0; d < DEVICES; d++) cp_pool_set_memory_cap(sh->pool[d], tight ? CAP_WHILE_TIGHT : 0);
      c->caps++;
    }
    if (done >= next_injection) { /* a driver allocation refused: the pool's out-of-memory ladder */
      next_injection = done + OPS_PER_INJECTION;
      const char *call = paged ? "cuMemCreate" : "cuMemAlloc";
      if (sa.fail_nth(call, 1 + (unsigned)rng_below(&rs, 4), 2 /* CUDA_ERROR_OUT_OF_MEMORY */) != 0)
        worker_error(sh, -1, "fail_nth", NULL, 0);
      c->injected++;
    }
    if (done >= next_check) {
      next_check = done + OPS_PER_CHECK;
      const size_t v = cp_pool_check(sh->pool[dev], stderr);
      if (v != 0) worker_error(sh, -1, "the checker found violations while running", NULL, v);
      cp_pool_info_t in;
      cp_pool_info(sh->pool[dev], &in);
      if (in.allocated > in.reserved || in.reserved > CAPACITY) worker_error(sh, -1, "info out of range", NULL, 0);
      c->checks++;
    }
    if (paged && done >= next_pause) { /* page-mapped pools pause: the region's memory back, then again */
      next_pause = done + OPS_PER_PAUSE;
      pthread_rwlock_wrlock(&sh->region_use);
      int rc = cp_pool_pause(sh->pool[0], sh->region, CP_PAUSE_BACKUP);
      if (rc == CP_ERR_STATE && strstr(cp_last_error(), "shared with another process") != NULL)
        atomic_fetch_add(&sh->pauses_refused_shared, 1); /* a block of the region is shared */
      else if (rc != CP_OK && rc != CP_ERR_OOM)
        worker_error(sh, -1, cp_last_error(), NULL, 0);
      for (int tries = 0; rc == CP_OK; tries++) {
        sa.complete_all();
        const int again = cp_pool_resume(sh->pool[0], sh->region);
        if (again == CP_OK) break;
        /* An injected refusal, or the tight cap below what the region needs: lifted, then again. */
        if (again != CP_ERR_OOM || tries >= 8) {
          worker_error(sh, -1, cp_last_error(), NULL, 0);
          break;
        }
        cp_pool_set_memory_cap(sh->pool[0], 0);
      }
      pthread_rwlock_unlock(&sh->region_use);
      c->pauses++;
    }
  }
  for (int d = 0; d < DEVICES; d++) cp_pool_set_memory_cap(sh->pool[d], 0);
}

/* ---- One run -------------------------------------------------------------------------------- */

static uintptr_t new_stream(int device) {
  void *prev = NULL, *ctx = NULL, *stream = NULL;
  CHECK(sa.cuCtxGetCurrent(&prev) == 0);
  CHECK(sa.cuDevicePrimaryCtxRetain(&ctx, device) == 0);
  CHECK(sa.cuCtxSetCurrent(ctx) == 0);
  CHECK(sa.cuStreamCreate(&stream, 1 /* non-blocking, as torch's side streams */) == 0);
  CHECK(sa.cuCtxSetCurrent(prev) == 0);
  CHECK(sa.cuDevicePrimaryCtxRelease(device) == 0);
  return (uintptr_t)stream;
}

static long g_iters = DEFAULT_ITERS;
static uint64_t g_seed = 20261204;
static long g_total_ops;

static void run(const char *conf) {
  cp_cuda_shutdown();
  sa.reset();
  REQUIRE(sa.set_devices(DEVICES, CAPACITY) == 0);
  shared_t sh;
  memset(&sh, 0, sizeof sh);
  sh.conf = conf;
  sh.iters = g_iters;
  sh.seed = g_seed;
  REQUIRE(cp_region_id("standin_threads_kv", &sh.region) == CP_OK);
  pthread_rwlock_init(&sh.region_use, NULL);
  for (int d = 0; d < DEVICES; d++) {
    REQUIRE(cp_cuda_backend(d, &sh.be[d]) == CP_OK);
    REQUIRE(sh.be[d].ipc_export != NULL && (sh.be[d].page_export != NULL || conf[0] == '\0'));
    cp_config_t cfg;
    cp_config_default(&cfg);
    REQUIRE(cp_config_parse(&cfg, conf) == CP_OK);
    REQUIRE(cp_pool_create(&cfg, &sh.be[d], &sh.pool[d]) == CP_OK);
    for (int s = 0; s < STREAMS; s++) sh.stream[d][s] = new_stream(d);
    pthread_mutex_init(&sh.live[d].lock, NULL);
    sh.live[d].cap = (size_t)THREADS * MAX_LIVE;
    sh.live[d].spans = calloc(sh.live[d].cap, sizeof(span_t));
    REQUIRE(sh.live[d].spans != NULL);
  }

  worker_t w[THREADS];
  atomic_store(&sh.workers_running, THREADS);
  const double t0 = now_s();
  for (int i = 0; i < THREADS; i++) {
    w[i] = (worker_t){&sh, i, 0};
    REQUIRE(pthread_create(&w[i].thread, NULL, worker_main, &w[i]) == 0);
  }
  driver_counts_t c;
  memset(&c, 0, sizeof c);
  driver_loop(&sh, &c);
  for (int i = 0; i < THREADS; i++) pthread_join(w[i].thread, NULL);
  const double seconds = now_s() - t0;

  CHECK_EQ_U(atomic_load(&sh.errors), 0);
  CHECK_EQ_U(atomic_load(&sh.allocs), atomic_load(&sh.frees));
  CHECK(atomic_load(&sh.shares) > 0 && atomic_load(&sh.exports) >= atomic_load(&sh.shares));
  if (sa.faults() != 0) print_faults();
  CHECK_EQ_U(sa.faults(), 0);
  sa.complete_all();
  for (int d = 0; d < DEVICES; d++) {
    CHECK_EQ_U(sh.live[d].n, 0);
    CHECK(cp_empty_cache(sh.pool[d]) == CP_OK);
    CHECK_EQ_U(cp_pool_check(sh.pool[d], stderr), 0);
    cp_pool_info_t in;
    cp_pool_info(sh.pool[d], &in);
    CHECK_EQ_U(in.allocated, 0);
    CHECK_EQ_U(in.live_blocks, 0);
    CHECK_EQ_U(in.pending_free + in.cached_free + in.allocated, in.reserved);
    CHECK_EQ_U(in.paused_bytes, 0);
    CHECK_EQ_U(in.backup_bytes, 0);
    cp_stats_t st;
    cp_pool_stats(sh.pool[d], &st);
    CHECK_EQ_U(st.family[CP_STAT_ALLOCATED_BYTES][CP_KIND_ALL].current, 0);
    CHECK_EQ_U(st.family[CP_STAT_RESERVED_BYTES][CP_KIND_ALL].current, (int64_t)in.reserved);
    cp_pool_destroy(sh.pool[d]);
    CHECK_EQ_U(sa.used(d), 0);
    for (int s = 0; s < STREAMS; s++) CHECK(sa.cuStreamDestroy((void *)sh.stream[d][s]) == 0);
    free(sh.live[d].spans);
    pthread_mutex_destroy(&sh.live[d].lock);
  }
  CHECK_EQ_U(sa.live(CPSTANDIN_LIVE_EVENTS), 0);
  CHECK_EQ_U(sa.live(CPSTANDIN_LIVE_HANDLES), 0);
  CHECK_EQ_U(sa.live(CPSTANDIN_LIVE_MAPPINGS), 0);
  CHECK_EQ_U(sa.live(CPSTANDIN_LIVE_RESERVATIONS), 0);
  CHECK_EQ_U(sa.live(CPSTANDIN_LIVE_ALLOCATIONS), 0);
  CHECK_EQ_U(sa.live(CPSTANDIN_LIVE_HOST), 0);
  CHECK_EQ_U(sa.live(CPSTANDIN_LIVE_STREAMS), 0);
  if (sa.faults() != 0) print_faults();
  CHECK_EQ_U(sa.faults(), 0);
  cp_cuda_shutdown();
  CHECK_EQ_U(sa.live(CPSTANDIN_LIVE_CONTEXTS), 0);
  pthread_rwlock_destroy(&sh.region_use);

  const long ops = atomic_load(&sh.allocs) + atomic_load(&sh.frees) + atomic_load(&sh.ooms) + atomic_load(&sh.records) +
                   atomic_load(&sh.paused_refusals) + atomic_load(&sh.shares) + atomic_load(&sh.shares_refused_paused);
  g_total_ops += ops;
  printf(
      "test_cuda_standin_threads: %s: %d threads, %d devices x %d streams: %ld operations (%ld allocations, "
      "%ld in the region, %ld record_stream, %ld out of memory, %ld refused while paused, %ld shared in %ld "
      "exports, %ld refused while paused); driver: %ld empty_cache, %ld cap changes, %ld refusals armed, %ld checks, "
      "%ld pauses and resumes "
      "(%ld refused for shared blocks); %.1f s, %.0f operations/s\n",
      conf[0] ? conf : "plain segments", THREADS, DEVICES, STREAMS, ops, atomic_load(&sh.allocs),
      atomic_load(&sh.region_allocs), atomic_load(&sh.records), atomic_load(&sh.ooms), atomic_load(&sh.paused_refusals),
      atomic_load(&sh.shares), atomic_load(&sh.exports), atomic_load(&sh.shares_refused_paused), c.empty_caches, c.caps,
      c.injected, c.checks, c.pauses, atomic_load(&sh.pauses_refused_shared), seconds, (double)ops / seconds);
  fflush(stdout);
}

TEST(threads_plain) { run(""); }

TEST(threads_expandable) { run("expandable_segments:True"); }

TEST(threads_stitching) { run("expandable_segments:True,page_stitching:True,release_before_grow:True"); }

int main(int argc, char **argv) {
  for (int i = 1; i + 1 < argc; i += 2) {
    char *end = NULL;
    const long long v = strtoll(argv[i + 1], &end, 10);
    if (end == argv[i + 1] || *end != '\0' || v < 1) {
      fprintf(stderr, "usage: test_cuda_standin_threads [--iters N] [--seed N]\n");
      return 2;
    }
    if (strcmp(argv[i], "--iters") == 0)
      g_iters = (long)v;
    else if (strcmp(argv[i], "--seed") == 0)
      g_seed = (uint64_t)v;
    else {
      fprintf(stderr, "usage: test_cuda_standin_threads [--iters N] [--seed N]\n");
      return 2;
    }
  }
  if (!standin_open_or_skip(&sa, "test_cuda_standin_threads")) return 0;
  RUN(threads_plain);
  RUN(threads_expandable);
  RUN(threads_stitching);
  printf("test_cuda_standin_threads: %ld operations in all\n", g_total_ops);
  cp_cuda_shutdown();
  sa.reset();
  return check_summary("test_cuda_standin_threads");
}
