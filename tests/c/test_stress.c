/* test_stress.c — threaded stress test of the whole pool on the simulated device.
 * Owns: many threads allocating and freeing on several streams at once, with record_stream,
 * events completed by another thread, empty_cache and cap changes racing with them. Every
 * block is stamped at allocation and verified at free: a wrong stamp means two live blocks
 * shared bytes. Ends with the invariant checker, zero allocated bytes and nothing reserved.
 * Runs twice: over plain segments, and over page-mapped ones (expandable_segments:True,
 * 256 KiB granularity), where growth maps chunks without the pool lock and empty_cache and
 * the OOM retry unmap them while other threads allocate, free and record streams. A third
 * run stitches (page_stitching:True, 256 KiB pages): sizes of many pages, freed at random,
 * leave scattered free pages that large requests take as stitched ranges and reuse, while
 * other threads free, record streams and empty the cache (which drops idle ranges).
 *
 *   test_stress [--threads N] [--iters N] [--streams N] [--seed N]
 *
 * Built with -DCP_CHECK_EVERY_OP (a full invariant check after every operation), the
 * default iteration count is smaller so that the run stays short. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "backend/sim.h"
#include "check.h"
#include "core/cp.h"
#include "rand.h"

#define KiB ((size_t)1 << 10)
#define MiB ((size_t)1 << 20)

#ifdef CP_CHECK_EVERY_OP
#define DEFAULT_ITERS 5000
#else
#define DEFAULT_ITERS 20000
#endif

#define MAX_LIVE        64          /* live blocks per thread at most */
#define SIM_CAPACITY    (512 * MiB) /* the device */
#define CAP_WHILE_TIGHT (128 * MiB) /* the cap the driver sets now and then */

/* ------------------------------------------------------------------------------------------
 * Options, shared state, random numbers
 * ---------------------------------------------------------------------------------------- */

typedef struct options_s {
  int threads;
  long iters;
  int streams;
  uint64_t seed;
} options_t;

typedef struct shared_s {
  cp_pool_t *pool;
  cp_sim_t *sim;
  options_t opt;
  atomic_int workers_running;
  atomic_long errors; /* failures seen by worker threads (CHECK is not thread-safe) */
  atomic_long allocs, frees, ooms, records, zero_allocs;
  int stitch; /* the stitching run: sizes of many pages */
} shared_t;

typedef struct worker_s {
  shared_t *sh;
  int id;
  pthread_t thread;
} worker_t;

static uint64_t mix64(uint64_t x) { /* splitmix64 finalizer */
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

static void worker_error(shared_t *sh, const char *what, int thread, const void *ptr, size_t size) {
  atomic_fetch_add(&sh->errors, 1);
  fprintf(stderr, "test_stress: thread %d: %s (ptr %p, size %zu)\n", thread, what, ptr, size);
}

/* ------------------------------------------------------------------------------------------
 * Stamps: the 8-byte word at offset o (o a multiple of 8) of a block with cookie c is
 * mix64(c + o / 8); a byte is that word's byte in memory. A block gets its first and last
 * 64 bytes stamped and the word at every 512-byte offset. Blocks start 512-aligned, so when
 * two blocks overlap, the start of one lies inside the other at a stamped offset of both.
 * ---------------------------------------------------------------------------------------- */

static uint64_t stamp_word(uint64_t cookie, size_t o) { return mix64(cookie + o / 8); }

/* Bytes [from, to) of the stamp, one word computed per 8 bytes. */
static void stamp_bytes(unsigned char *p, size_t from, size_t to, uint64_t cookie) {
  unsigned char w[8];
  for (size_t o = from; o < to; o++) {
    if (o == from || o % 8 == 0) {
      uint64_t x = stamp_word(cookie, o);
      memcpy(w, &x, 8);
    }
    p[o] = w[o % 8];
  }
}

static size_t stamp_bytes_verify(const unsigned char *p, size_t from, size_t to, uint64_t cookie) {
  unsigned char w[8];
  for (size_t o = from; o < to; o++) {
    if (o == from || o % 8 == 0) {
      uint64_t x = stamp_word(cookie, o);
      memcpy(w, &x, 8);
    }
    if (p[o] != w[o % 8]) return o;
  }
  return SIZE_MAX;
}

/* Under TSan, stamping every page of the large blocks dominates the run: TSan resets its
 * shadow memory from time to time, and each page touched afterwards costs shadow faults.
 * There, blocks above 1 MiB get words every 512 bytes only in their first and last 64 KiB
 * and every 64 KiB in between; TSan itself reports two threads writing the same bytes. The
 * other builds keep the dense stamps and with them the overlap guarantee. */
#if defined(__SANITIZE_THREAD__)
#define SPARSE_STAMPS 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define SPARSE_STAMPS 1
#endif
#endif
#ifndef SPARSE_STAMPS
#define SPARSE_STAMPS 0
#endif

/* The stamped word after offset o in a block of n bytes. */
static size_t next_stamp(size_t o, size_t n) {
  if (SPARSE_STAMPS && n > MiB && o >= 64 * KiB && o + 128 * KiB <= n) return o + 64 * KiB;
  return o + 512;
}

/* The words at 512-byte offsets are 8-aligned (blocks are 512-aligned): plain stores. */
static void stamp(unsigned char *p, size_t n, uint64_t cookie) {
  stamp_bytes(p, 0, n < 64 ? n : 64, cookie);
  for (size_t o = 512; o + 8 <= n; o = next_stamp(o, n)) *(uint64_t *)(void *)(p + o) = stamp_word(cookie, o);
  stamp_bytes(p, n > 64 ? n - 64 : 0, n, cookie);
}

/* Returns the first offset whose byte is wrong, or SIZE_MAX when all are right. */
static size_t stamp_verify(const unsigned char *p, size_t n, uint64_t cookie) {
  size_t bad = stamp_bytes_verify(p, 0, n < 64 ? n : 64, cookie);
  if (bad != SIZE_MAX) return bad;
  for (size_t o = 512; o + 8 <= n; o = next_stamp(o, n))
    if (*(const uint64_t *)(const void *)(p + o) != stamp_word(cookie, o)) return o;
  return stamp_bytes_verify(p, n > 64 ? n - 64 : 0, n, cookie);
}

/* ------------------------------------------------------------------------------------------
 * Workers
 * ---------------------------------------------------------------------------------------- */

typedef struct live_s {
  unsigned char *ptr;
  size_t size;
  cp_stream_t stream;
  uint64_t cookie;
} live_t;

/* Mostly small (1 B – 64 KiB), some 1–4 MiB, rarely 12–24 MiB (own segments). The large
 * ones are kept few: every byte of a block is in a page the stamps touch, and under TSan
 * each fresh page costs shadow-page faults. */
static size_t random_size(uint64_t *rs, int stitch) {
  uint64_t r = rng_below(rs, 1000);
  if (stitch) { /* mostly small; a third 2–16 pages of 256 KiB (stitched from holes); rarely more */
    if (r < 700) return 1 + (size_t)rng_below(rs, 64 * KiB);
    if (r < 995) return 512 * KiB + (size_t)rng_below(rs, 3584 * KiB + 1);
    return 4 * MiB + (size_t)rng_below(rs, 4 * MiB + 1);
  }
  if (r < 968) return 1 + (size_t)rng_below(rs, 64 * KiB);
  if (r < 998) return 1 * MiB + (size_t)rng_below(rs, 3 * MiB + 1);
  return 12 * MiB + (size_t)rng_below(rs, 12 * MiB + 1);
}

static void free_one(shared_t *sh, int id, live_t *l, uint64_t *rs) {
  size_t bad = stamp_verify(l->ptr, l->size, l->cookie);
  if (bad != SIZE_MAX) {
    fprintf(stderr, "test_stress: thread %d: block %p (%zu bytes, stream %lu) overwritten at offset %zu\n", id,
            (void *)l->ptr, l->size, (unsigned long)l->stream, bad);
    worker_error(sh, "stamp mismatch: two live blocks overlapped", id, l->ptr, l->size);
  }
  /* Sometimes the block was also used on other streams: tell the pool before freeing. */
  if (rng_below(rs, 8) == 0) {
    int n = 1 + (int)rng_below(rs, 3);
    for (int k = 0; k < n; k++) {
      /* Any stream the test uses, the allocation stream (a no-op), or a side stream that
       * never allocates. */
      cp_stream_t other = (cp_stream_t)rng_below(rs, (uint64_t)sh->opt.streams + 3);
      if (cp_record_stream(sh->pool, l->ptr, other) != CP_OK) worker_error(sh, cp_last_error(), id, l->ptr, l->size);
      /* ... and work there uses it, queued until the driver thread completes that stream. */
      if (cp_sim_launch(sh->sim, other, (uintptr_t)l->ptr, l->size) != CP_OK)
        worker_error(sh, cp_last_error(), id, l->ptr, l->size);
      atomic_fetch_add(&sh->records, 1);
    }
  }
  if (cp_free(sh->pool, l->ptr) != CP_OK) worker_error(sh, cp_last_error(), id, l->ptr, l->size);
  atomic_fetch_add(&sh->frees, 1);
  l->ptr = NULL;
}

static void *worker_main(void *arg) {
  worker_t *w = arg;
  shared_t *sh = w->sh;
  const int id = w->id;
  uint64_t rs = mix64(sh->opt.seed + 0x1000u * (uint64_t)(id + 1)) | 1;
  const cp_stream_t own = (cp_stream_t)(id % sh->opt.streams) + 1;
  live_t live[MAX_LIVE];
  int n_live = 0;
  uint64_t seq = 0;

  for (long it = 0; it < sh->opt.iters; it++) {
    int do_free = n_live == MAX_LIVE || (n_live > 0 && rng_below(&rs, 2) == 0);
    if (do_free) {
      int k = (int)rng_below(&rs, (uint64_t)n_live);
      free_one(sh, id, &live[k], &rs);
      live[k] = live[--n_live];
      continue;
    }
    if (rng_below(&rs, 512) == 0) { /* size 0: NULL and CP_OK, nothing to free */
      void *p = (void *)1;
      if (cp_alloc(sh->pool, 0, own, &p) != CP_OK || p != NULL) worker_error(sh, "alloc of 0 bytes", id, p, 0);
      if (cp_free(sh->pool, NULL) != CP_OK) worker_error(sh, "free(NULL)", id, NULL, 0);
      atomic_fetch_add(&sh->zero_allocs, 1);
      continue;
    }
    size_t size = random_size(&rs, sh->stitch);
    cp_stream_t stream = rng_below(&rs, 8) == 0 ? 0 : own; /* some work on the default stream */
    void *p = NULL;
    int rc = cp_alloc(sh->pool, size, stream, &p);
    if (rc == CP_ERR_OOM) {
      atomic_fetch_add(&sh->ooms, 1);
      continue;
    }
    if (rc != CP_OK || p == NULL || ((uintptr_t)p % 512) != 0) {
      worker_error(sh, rc != CP_OK ? cp_last_error() : "bad pointer", id, p, size);
      continue;
    }
    atomic_fetch_add(&sh->allocs, 1);
    /* No other stream's queued work may touch what was handed out; then this stream's does
     * (Note [Simulated asynchrony] in backend/sim.h). */
    if (cp_sim_check_handoff(sh->sim, stream, (uintptr_t)p, size) != 0) worker_error(sh, "handoff", id, p, size);
    if (cp_sim_launch(sh->sim, stream, (uintptr_t)p, size) != CP_OK) worker_error(sh, cp_last_error(), id, p, size);
    live_t *l = &live[n_live++];
    l->ptr = p;
    l->size = size;
    l->stream = stream;
    l->cookie = mix64((uint64_t)(uintptr_t)p ^ ((uint64_t)id << 48) ^ (++seq * 0x9E3779B97F4A7C15ull));
    stamp(l->ptr, l->size, l->cookie);
  }
  while (n_live > 0) free_one(sh, id, &live[--n_live], &rs);
  atomic_fetch_sub(&sh->workers_running, 1);
  return NULL;
}

/* ------------------------------------------------------------------------------------------
 * The driver: while workers run, complete stream work, empty the cache, tighten and lift a
 * memory cap, and look at the pool from outside.
 * ---------------------------------------------------------------------------------------- */

/* Device progress follows the clock (a tick is ~100 us); empty_cache, the cap and the
 * checker follow the workers' progress, so that slow (sanitized) and fast builds see about
 * as many of them per operation. */
#define ALLOCS_PER_EMPTY_CACHE 1500
#define ALLOCS_PER_CAP_TOGGLE  700
#define ALLOCS_PER_CHECK       600

static long driver_loop(shared_t *sh, long *empty_caches, long *checks) {
  uint64_t rs = mix64(sh->opt.seed ^ 0xD1B54A32D192ED03ull) | 1;
  long ticks = 0, next_empty = ALLOCS_PER_EMPTY_CACHE, next_cap = ALLOCS_PER_CAP_TOGGLE;
  long next_check = ALLOCS_PER_CHECK;
  int tight = 0;
  while (atomic_load(&sh->workers_running) > 0) {
    struct timespec ts = {0, 100 * 1000};
    nanosleep(&ts, NULL);
    ticks++;
    uint64_t r = rng_below(&rs, 100);
    if (r < 60) {
      cp_sim_complete_all(sh->sim);
    } else if (r < 90) {
      /* One stream only: its events complete in order, the others keep waiting. */
      cp_sim_complete(sh->sim, (cp_stream_t)rng_below(&rs, (uint64_t)sh->opt.streams + 3));
    }
    long done = atomic_load(&sh->allocs) + atomic_load(&sh->ooms);
    if (done >= next_empty) {
      next_empty = done + ALLOCS_PER_EMPTY_CACHE;
      int rc = cp_empty_cache(sh->pool);
      if (rc != CP_OK) worker_error(sh, cp_last_error(), -1, NULL, 0);
      (*empty_caches)++;
    }
    if (done >= next_cap) {
      next_cap = done + ALLOCS_PER_CAP_TOGGLE;
      tight = !tight;
      cp_pool_set_memory_cap(sh->pool, tight ? CAP_WHILE_TIGHT : 0);
    }
    if (ticks % 31 == 0) {
      cp_stats_t st;
      cp_pool_info_t info;
      cp_pool_stats(sh->pool, &st);
      cp_pool_info(sh->pool, &info);
      if (st.family[CP_STAT_ALLOCATED_BYTES][CP_KIND_ALL].current < 0 ||
          st.family[CP_STAT_RESERVED_BYTES][CP_KIND_ALL].current <
              st.family[CP_STAT_ALLOCATED_BYTES][CP_KIND_ALL].current ||
          info.reserved > SIM_CAPACITY)
        worker_error(sh, "stats out of range while running", -1, NULL, 0);
    }
    if (done >= next_check) {
      next_check = done + ALLOCS_PER_CHECK;
      size_t v = cp_pool_check(sh->pool, stderr);
      if (v != 0) worker_error(sh, "cp_pool_check found violations while running", -1, NULL, v);
      (*checks)++;
    }
  }
  cp_pool_set_memory_cap(sh->pool, 0);
  return ticks;
}

/* ------------------------------------------------------------------------------------------
 * main
 * ---------------------------------------------------------------------------------------- */

static int parse_options(int argc, char **argv, options_t *opt) {
  opt->threads = 4;
  opt->iters = DEFAULT_ITERS;
  opt->streams = 4;
  opt->seed = 12345;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (i + 1 >= argc) {
      fprintf(stderr, "test_stress: %s needs a value\n", a);
      return -1;
    }
    char *end = NULL;
    long long v = strtoll(argv[++i], &end, 10);
    if (end == NULL || *end != '\0' || v < 0) {
      fprintf(stderr, "test_stress: bad value for %s: %s\n", a, argv[i]);
      return -1;
    }
    if (strcmp(a, "--threads") == 0 && v >= 1 && v <= 256)
      opt->threads = (int)v;
    else if (strcmp(a, "--iters") == 0)
      opt->iters = (long)v;
    else if (strcmp(a, "--streams") == 0 && v >= 1 && v <= 1024)
      opt->streams = (int)v;
    else if (strcmp(a, "--seed") == 0)
      opt->seed = (uint64_t)v;
    else {
      fprintf(stderr, "usage: test_stress [--threads 1..256] [--iters N] [--streams 1..1024] [--seed N]\n");
      return -1;
    }
  }
  return 0;
}

static options_t g_opt;

/* mode: 0 plain segments, 1 page-mapped, 2 page-mapped with stitching. */
static void run_threads(int mode) {
  const int paged = mode != 0;
  shared_t sh;
  memset(&sh, 0, sizeof sh);
  sh.opt = g_opt;
  sh.stitch = mode == 2;
  REQUIRE(cp_sim_create(SIM_CAPACITY, 0, &sh.sim) == CP_OK); /* events wait for the driver */
  if (paged) REQUIRE(cp_sim_set_vmm_granularity(sh.sim, 256 * KiB) == CP_OK);
  cp_backend_t be;
  cp_sim_backend(sh.sim, &be);
  cp_config_t cfg;
  cp_config_default(&cfg);
  if (paged)
    REQUIRE(cp_config_parse(&cfg, sh.stitch ? "expandable_segments:True,page_stitching:True"
                                            : "expandable_segments:True") == CP_OK);
  REQUIRE(cp_pool_create(&cfg, &be, &sh.pool) == CP_OK);
  {
    cp_pool_info_t in;
    cp_pool_info(sh.pool, &in);
    REQUIRE(in.page_mapped == paged);
  }

  worker_t *workers = calloc((size_t)sh.opt.threads, sizeof *workers);
  REQUIRE(workers != NULL);
  atomic_store(&sh.workers_running, sh.opt.threads);
  double t0 = now_s();
  int started = 0;
  for (int i = 0; i < sh.opt.threads; i++) {
    workers[i].sh = &sh;
    workers[i].id = i;
    if (pthread_create(&workers[i].thread, NULL, worker_main, &workers[i]) != 0) {
      atomic_fetch_sub(&sh.workers_running, sh.opt.threads - i);
      break;
    }
    started++;
  }
  CHECK_EQ_U(started, sh.opt.threads);
  long empty_caches = 0, checks = 0;
  long ticks = driver_loop(&sh, &empty_caches, &checks);
  for (int i = 0; i < started; i++) pthread_join(workers[i].thread, NULL);
  double elapsed = now_s() - t0;
  free(workers);

  CHECK_EQ_U(atomic_load(&sh.errors), 0);
  CHECK_EQ_U(atomic_load(&sh.allocs), atomic_load(&sh.frees));

  /* No device fault all along: nothing unmapped or handed over under queued work. */
  CHECK_EQ_U(cp_sim_print_device_faults(sh.sim, stderr), 0);
  /* Everything is freed; once every stream has caught up nothing is pending either. */
  cp_sim_complete_all(sh.sim);
  CHECK(cp_empty_cache(sh.pool) == CP_OK);
  CHECK_EQ_U(cp_pool_check(sh.pool, stderr), 0);
  cp_stats_t st;
  cp_pool_stats(sh.pool, &st);
  CHECK_EQ_U(st.family[CP_STAT_ALLOCATED_BYTES][CP_KIND_ALL].current, 0);
  CHECK_EQ_U(st.family[CP_STAT_ALLOCATION][CP_KIND_ALL].current, 0);
  CHECK_EQ_U(st.family[CP_STAT_ACTIVE][CP_KIND_ALL].current, 0);
  CHECK_EQ_U(st.family[CP_STAT_REQUESTED_BYTES][CP_KIND_ALL].current, 0);
  CHECK_EQ_U(st.family[CP_STAT_RESERVED_BYTES][CP_KIND_ALL].current, 0);
  CHECK_EQ_U(st.family[CP_STAT_SEGMENT][CP_KIND_ALL].current, 0);
  CHECK_EQ_U(st.family[CP_STAT_ALLOCATION][CP_KIND_ALL].allocated, atomic_load(&sh.allocs));
  CHECK_EQ_U(st.num_ooms, atomic_load(&sh.ooms));
  CHECK(st.family[CP_STAT_RESERVED_BYTES][CP_KIND_ALL].peak <= (int64_t)SIM_CAPACITY);
  /* Page-mapped: device_alloc counts mappings, device_free unmapped ranges (as torch's). */
  if (!paged) CHECK_EQ_U(st.num_device_alloc, st.num_device_free);
  cp_pool_info_t info;
  cp_pool_info(sh.pool, &info);
  CHECK_EQ_U(info.live_blocks, 0);
  CHECK_EQ_U(info.pending_blocks, 0);
  CHECK_EQ_U(info.pending_free, 0);
  CHECK_EQ_U(info.segments, 0);
  CHECK_EQ_U(info.page_segments, 0);
  CHECK_EQ_U(info.stitched_ranges, 0); /* empty_cache dropped every idle range */
  CHECK_EQ_U(info.stitched_space, 0);
  if (sh.stitch) {
    CHECK(info.stitches > 0);                                              /* the run did stitch */
    CHECK_EQ_U(st.family[CP_STAT_ALLOCATION][CP_KIND_SMALL].allocated, 0); /* one range serves every size */
  } else {
    CHECK_EQ_U(info.stitches, 0);
  }
  CHECK_EQ_U(cp_sim_reserved_bytes(sh.sim), 0);
  CHECK_EQ_U(cp_sim_live_reservations(sh.sim), 0);
  CHECK_EQ_U(cp_sim_vmm_ranges(sh.sim), 0);
  CHECK_EQ_U(cp_sim_vmm_pages(sh.sim), 0);
  CHECK_EQ_U(cp_sim_vmm_mappings(sh.sim), 0);

  cp_pool_destroy(sh.pool);
  CHECK_EQ_U(cp_sim_live_events(sh.sim), 0); /* the pool gave back every event it made */
  CHECK_EQ_U(cp_sim_reserved_bytes(sh.sim), 0);
  cp_sim_destroy(sh.sim);

  long ops = atomic_load(&sh.allocs) + atomic_load(&sh.frees) + atomic_load(&sh.ooms) + atomic_load(&sh.records) +
             atomic_load(&sh.zero_allocs);
  printf(
      "test_stress: %s: threads=%d streams=%d iters=%ld: %ld ops (%ld allocs, %ld frees, %ld record_stream, "
      "%ld OOMs), %ld driver ticks, %ld empty_cache, %ld checks, %lld segments reserved, peak %.1f MiB, "
      "%zu stitched ranges (%zu reuses), %s stamps, %.2f s\n",
      sh.stitch ? "stitching"
      : paged   ? "page-mapped"
                : "plain",
      sh.opt.threads, sh.opt.streams, sh.opt.iters, ops, atomic_load(&sh.allocs), atomic_load(&sh.frees),
      atomic_load(&sh.records), atomic_load(&sh.ooms), ticks, empty_caches, checks, (long long)st.num_device_alloc,
      (double)st.family[CP_STAT_RESERVED_BYTES][CP_KIND_ALL].peak / (double)MiB, info.stitches, info.stitch_reuses,
      SPARSE_STAMPS ? "sparse" : "dense", elapsed);
}

TEST(threads_on_streams) { run_threads(0); }

TEST(threads_on_streams_page_mapped) { run_threads(1); }

TEST(threads_on_streams_stitching) { run_threads(2); }

int main(int argc, char **argv) {
  if (parse_options(argc, argv, &g_opt) != 0) return 2;
  RUN(threads_on_streams);
  RUN(threads_on_streams_page_mapped);
  RUN(threads_on_streams_stitching);
  return check_summary("test_stress");
}
