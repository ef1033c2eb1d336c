/* conformance.h — the pool's conformance suite, written once and run for every (backend, pool
 * kind): sizes, splitting, reuse, the OOM ladder, the cap, empty_cache, stream ordering,
 * statistics and bad input. test_pool.c runs it on the simulated device, test_cuda_standin_pool.c
 * through the CUDA backend on the driver stand-in; cf_suite() is the whole of it. */
#ifndef CP_TEST_CONFORMANCE_H
#define CP_TEST_CONFORMANCE_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda.h"
#include "backend/sim.h"
#include "check.h"
#include "core/cp.h"
#include "fixture.h"
#include "standin/standin.h"

#define CUR(s, fam, kind)  ((s).family[CP_STAT_##fam][CP_KIND_##kind].current)
#define PEAK(s, fam, kind) ((s).family[CP_STAT_##fam][CP_KIND_##kind].peak)

/* The conformance checks that hold for every kind of pool run three times (cf_suite): over plain
 * segments, over page-mapped ones (PAGED_CONF, core/expand.c) and over page-mapped ones that
 * stitch (STITCH_CONF, core/stitch.c). Where the kinds differ by design (a page-mapped pool
 * maps whole chunks of one range per stream and kind, counts no segments in the segment stat,
 * unmaps a free range in one call; a stitching pool maps one page at a time, of one range per
 * stream for every size), the expectation depends on g_paged / g_stitch and says why. */
#define PAGED_CONF  "expandable_segments:True"
#define STITCH_CONF "expandable_segments:True,page_stitching:True"
static int g_paged = 0;
static int g_stitch = 0; /* with g_paged */

/* The backend: the simulated device, or (g_cuda) the CUDA backend on the stand-in `g_sa`, one
 * device of the test's capacity, each stream number a non-blocking stream of its own. Device
 * calls are counted by the sim's call ids (cf_calls); a case the CUDA backend cannot run says
 * why (cf_skip_on_cuda). */
static int g_cuda = 0;
static cpstandin_api_t g_sa;
static int g_skipped = 0;

#define CF_STREAMS 128
typedef struct cf_fixture_s {
  cp_sim_t *sim; /* NULL on the CUDA backend */
  cp_backend_t backend;
  cp_pool_t *pool;
  uintptr_t streams[CF_STREAMS]; /* CUDA: the stream of each number, 0 until first used */
} cf_fixture_t;

/* The simulated device's fixture (fixture.h) of `fx`. */
static inline fixture_t cf_sim_fixture(const cf_fixture_t *fx) { return (fixture_t){fx->sim, fx->backend, fx->pool}; }

static inline int cf_skip_on_cuda(const char *name, const char *why) {
  if (!g_cuda) return 0;
  printf("  %s: skipped on the CUDA backend: %s\n", name, why);
  g_skipped++;
  return 1;
}

static inline int cf_open(cf_fixture_t *fx, size_t capacity, const char *conf) {
  memset(fx, 0, sizeof *fx);
  if (!g_cuda) {
    fixture_t f;
    const int rc = fx_open(&f, capacity, conf);
    fx->sim = f.sim;
    fx->backend = f.backend;
    fx->pool = f.pool;
    return rc;
  }
  cp_config_t cfg;
  cp_config_default(&cfg);
  cp_cuda_shutdown();
  g_sa.reset();
  if (cp_config_parse(&cfg, conf) != CP_OK || g_sa.set_devices(1, capacity) != 0 ||
      cp_cuda_backend(0, &fx->backend) != CP_OK)
    return -1;
  if (cp_pool_create(&cfg, &fx->backend, &fx->pool) != CP_OK) {
    fprintf(stderr, "pool (%s): %s\n", conf, cp_last_error());
    return -1;
  }
  return 0;
}

/* The stream the case calls `i`. */
static inline cp_stream_t cf_stream(cf_fixture_t *fx, cp_stream_t i) {
  if (!g_cuda) return i;
  if (i >= CF_STREAMS) return (cp_stream_t)-1;
  if (fx->streams[i] == 0) {
    void *prev = NULL, *ctx = NULL, *stream = NULL;
    CHECK(g_sa.cuCtxGetCurrent(&prev) == 0 && g_sa.cuDevicePrimaryCtxRetain(&ctx, 0) == 0);
    CHECK(g_sa.cuCtxSetCurrent(ctx) == 0 && g_sa.cuStreamCreate(&stream, 1 /* CU_STREAM_NON_BLOCKING */) == 0);
    CHECK(g_sa.cuCtxSetCurrent(prev) == 0 && g_sa.cuDevicePrimaryCtxRelease(0) == 0);
    fx->streams[i] = (uintptr_t)stream;
  }
  return fx->streams[i];
}

/* Device calls of the sim's kind `id` so far; on the stand-in, those of the driver function
 * that the CUDA backend makes for it. */
static inline uint64_t cf_calls(cf_fixture_t *fx, int id) {
  if (!g_cuda) return cp_sim_calls(fx->sim, id);
  static const struct {
    int id;
    const char *name;
  } calls[] = {{CP_SIM_RESERVE, "cuMemAlloc"},         {CP_SIM_RELEASE, "cuMemFree"},
               {CP_SIM_PAGE_CREATE, "cuMemCreate"},    {CP_SIM_EVENT_CREATE, "cuEventCreate"},
               {CP_SIM_EVENT_RECORD, "cuEventRecord"}, {CP_SIM_EVENT_SYNCHRONIZE, "cuEventSynchronize"}};
  for (size_t i = 0; i < sizeof calls / sizeof *calls; i++)
    if (calls[i].id == id) return g_sa.calls(calls[i].name);
  fprintf(stderr, "cf_calls: no driver function for the sim's call %d\n", id);
  CHECK(0);
  return 0;
}

/* Bytes the device holds for the pool. */
static inline size_t cf_device_used(cf_fixture_t *fx) { return g_cuda ? g_sa.used(0) : cp_sim_reserved_bytes(fx->sim); }

/* Work queued on stream `s` over the live allocation [p, p + n). */
static inline void cf_launch(cf_fixture_t *fx, cp_stream_t s, const void *p, size_t n) {
  const cp_stream_t stream = cf_stream(fx, s);
  CHECK(g_cuda ? g_sa.launch(stream, (uintptr_t)p, n) == 0 : cp_sim_launch(fx->sim, stream, (uintptr_t)p, n) == CP_OK);
}

static inline void cf_complete(cf_fixture_t *fx, cp_stream_t s) {
  if (g_cuda)
    CHECK(g_sa.complete(cf_stream(fx, s)) == 0);
  else
    cp_sim_complete(fx->sim, s);
}

static inline void cf_complete_all(cf_fixture_t *fx) {
  if (g_cuda)
    g_sa.complete_all();
  else
    cp_sim_complete_all(fx->sim);
}

/* No device fault so far; they are printed. */
static inline void cf_no_faults(cf_fixture_t *fx) {
  if (!g_cuda) {
    fx_no_faults(fx->sim);
    return;
  }
  char text[256];
  for (size_t i = 0; i < g_sa.faults() && g_sa.fault_text(i, text, sizeof text) == 0; i++)
    fprintf(stderr, "  stand-in fault %zu: %s\n", i, text);
  CHECK_EQ_U(g_sa.faults(), 0);
}

/* The pool is whole, and destroying it gives everything back to the device. */
static inline void cf_close(cf_fixture_t *fx) {
  if (!g_cuda) {
    fixture_t f = cf_sim_fixture(fx);
    fx_close(&f);
    return;
  }
  CHECK_EQ_U(cp_pool_check(fx->pool, stderr), 0);
  cf_no_faults(fx);
  cf_complete_all(fx); /* destroying a pool unmaps everything at once: its caller waits first */
  cp_pool_destroy(fx->pool);
  cf_no_faults(fx);
  for (size_t i = 0; i < CF_STREAMS; i++)
    if (fx->streams[i] != 0) CHECK(g_sa.cuStreamDestroy((void *)fx->streams[i]) == 0);
  CHECK_EQ_U(g_sa.used(0), 0);
  const int kinds[] = {CPSTANDIN_LIVE_ALLOCATIONS, CPSTANDIN_LIVE_RESERVATIONS, CPSTANDIN_LIVE_HANDLES,
                       CPSTANDIN_LIVE_MAPPINGS,    CPSTANDIN_LIVE_EVENTS,       CPSTANDIN_LIVE_STREAMS};
  for (size_t i = 0; i < sizeof kinds / sizeof *kinds; i++) CHECK_EQ_U(g_sa.live(kinds[i]), 0);
  cp_cuda_shutdown();
  CHECK_EQ_U(g_sa.live(CPSTANDIN_LIVE_CONTEXTS), 0);
}

/* fixture.h's stats_of and info_of, which read the pool alone, on either backend. */
static inline cp_stats_t cf_stats(cf_fixture_t *fx) {
  fixture_t f = cf_sim_fixture(fx);
  return stats_of(&f);
}

static inline cp_pool_info_t cf_info(cf_fixture_t *fx) {
  fixture_t f = cf_sim_fixture(fx);
  return info_of(&f);
}

/* An allocation on the stream the case calls `s` that must succeed (fixture.h's must_alloc). */
static inline void *cf_must_alloc(cf_fixture_t *fx, size_t size, cp_stream_t s) {
  if (!g_cuda) {
    fixture_t f = cf_sim_fixture(fx);
    return must_alloc(&f, size, s);
  }
  const cp_stream_t stream = cf_stream(fx, s);
  void *p = NULL;
  int rc = cp_alloc(fx->pool, size, stream, &p);
  if (rc != CP_OK) fprintf(stderr, "alloc(%zu) failed: %s\n", size, cp_last_error());
  CHECK(rc == CP_OK);
  CHECK(p != NULL);
  return p; /* a handoff under other streams' work faults when that memory is unmapped */
}

/* cf_open with the pool kind of this pass; `paged_extra` is added for page-mapped pools. */
static int open_kind(cf_fixture_t *fx, size_t capacity, const char *conf, const char *paged_extra) {
  char text[512];
  snprintf(text, sizeof text, "%s%s%s%s%s", conf != NULL ? conf : "", conf != NULL && g_paged ? "," : "",
           g_paged ? (g_stitch ? STITCH_CONF : PAGED_CONF) : "", g_paged && paged_extra != NULL ? "," : "",
           g_paged && paged_extra != NULL ? paged_extra : "");
  if (cf_open(fx, capacity, text) != 0) return -1;
  return cf_info(fx).page_mapped == g_paged ? 0 : -1;
}

/* The device calls that grow a pool: a plain reservation, or a page for a page-mapped chunk. */
static uint64_t grow_calls(cf_fixture_t *fx) { return cf_calls(fx, g_paged ? CP_SIM_PAGE_CREATE : CP_SIM_RESERVE); }

TEST(size_zero) {
  cf_fixture_t fx;
  REQUIRE(open_kind(&fx, 64 * MiB, NULL, NULL) == 0);
  void *p = (void *)1;
  CHECK(cp_alloc(fx.pool, 0, cf_stream(&fx, 0), &p) == CP_OK);
  CHECK(p == NULL);
  CHECK(cp_free(fx.pool, NULL) == CP_OK);
  cp_stats_t s = cf_stats(&fx);
  CHECK_EQ_U(CUR(s, ALLOCATION, ALL), 0);
  CHECK_EQ_U(grow_calls(&fx), 0);
  cf_close(&fx);
}

TEST(small_request_stats) {
  cf_fixture_t fx;
  REQUIRE(open_kind(&fx, 64 * MiB, NULL, NULL) == 0);
  void *p = cf_must_alloc(&fx, 1000, 0);
  CHECK((uintptr_t)p % 512 == 0);
  cp_stats_t s = cf_stats(&fx);
  CHECK_EQ_U(CUR(s, ALLOCATION, ALL), 1);
  CHECK_EQ_U(CUR(s, ALLOCATION, SMALL), 1);
  CHECK_EQ_U(CUR(s, ALLOCATION, LARGE), 0);
  CHECK_EQ_U(CUR(s, ALLOCATED_BYTES, ALL), 1024);
  CHECK_EQ_U(CUR(s, REQUESTED_BYTES, ALL), 1000);
  CHECK_EQ_U(CUR(s, RESERVED_BYTES, SMALL), 2 * MiB);
  CHECK_EQ_U(CUR(s, SEGMENT, SMALL), 1);
  CHECK_EQ_U(CUR(s, INACTIVE_SPLIT, SMALL), 1); /* the rest of the segment */
  CHECK_EQ_U(CUR(s, INACTIVE_SPLIT_BYTES, SMALL), 2 * MiB - 1024);
  CHECK_EQ_U(s.num_device_alloc, 1);
  CHECK(s.max_split_size == -1);
  CHECK(cp_free(fx.pool, p) == CP_OK);
  s = cf_stats(&fx);
  CHECK_EQ_U(CUR(s, ALLOCATION, ALL), 0);
  CHECK_EQ_U(CUR(s, ALLOCATED_BYTES, ALL), 0);
  CHECK_EQ_U(CUR(s, ACTIVE, ALL), 0);
  CHECK_EQ_U(CUR(s, REQUESTED_BYTES, ALL), 0);
  CHECK_EQ_U(CUR(s, INACTIVE_SPLIT, ALL), 0);       /* merged back into one whole segment */
  CHECK_EQ_U(CUR(s, RESERVED_BYTES, ALL), 2 * MiB); /* cached, not returned */
  CHECK_EQ_U(PEAK(s, ALLOCATED_BYTES, ALL), 1024);
  CHECK_EQ_U(s.family[CP_STAT_ALLOCATION][CP_KIND_ALL].allocated, 1);
  CHECK_EQ_U(s.family[CP_STAT_ALLOCATION][CP_KIND_ALL].freed, 1);
  cf_close(&fx);
}

TEST(rounding) {
  cf_fixture_t fx;
  REQUIRE(open_kind(&fx, 64 * MiB, NULL, NULL) == 0);
  size_t sizes[] = {1, 511, 512, 513, 1 * MiB, 1 * MiB + 1};
  size_t expect[] = {512, 512, 512, 1024, 1 * MiB, 1 * MiB + 512};
  for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
    void *p = cf_must_alloc(&fx, sizes[i], 0);
    cp_stats_t s = cf_stats(&fx);
    CHECK_EQ_U(CUR(s, ALLOCATED_BYTES, ALL), expect[i]);
    CHECK(cp_free(fx.pool, p) == CP_OK);
  }
  cp_stats_t s = cf_stats(&fx);
  CHECK_EQ_U(CUR(s, SEGMENT, SMALL), 1); /* 1 MiB is still small */
  CHECK_EQ_U(CUR(s, SEGMENT, LARGE), 1); /* 1 MiB + 1 is large: one 20 MiB segment */
  CHECK_EQ_U(CUR(s, RESERVED_BYTES, LARGE), 20 * MiB);
  cf_close(&fx);
}

TEST(cached_block_reused_without_reserve) {
  cf_fixture_t fx;
  REQUIRE(open_kind(&fx, 256 * MiB, NULL, NULL) == 0);
  size_t sizes[] = {4096, 700 * KiB, 3 * MiB, 15 * MiB};
  for (size_t i = 0; i < 4; i++) {
    void *first = cf_must_alloc(&fx, sizes[i], 0);
    CHECK(cp_free(fx.pool, first) == CP_OK);
    uint64_t reserves = grow_calls(&fx);
    for (int k = 0; k < 100; k++) {
      void *p = cf_must_alloc(&fx, sizes[i], 0);
      CHECK(p == first);
      CHECK(cp_free(fx.pool, p) == CP_OK);
    }
    CHECK_EQ_U(grow_calls(&fx), reserves);
  }
  /* One small segment; one 20 MiB segment that serves both 3 MiB and, whole again, 15 MiB.
   * Stitching: one range serves every size, and each growth maps one handle of what it
   * lacks (handles of at most 20 MiB): a page for 4 KiB (700 KiB fits behind it), one more
   * for 3 MiB, one of 12 MiB for 15. */
  CHECK_EQ_U(grow_calls(&fx), g_stitch ? 3 : 2);
  cf_close(&fx);
}

TEST(first_address_back_after_coalescing) {
  cf_fixture_t fx;
  REQUIRE(open_kind(&fx, 256 * MiB, NULL, NULL) == 0);
  enum { N = 120 };
  void *p[N];
  srand(7);
  /* At most 120 x 16 KiB: everything comes from one 2 MiB segment. */
  for (int i = 0; i < N; i++) p[i] = cf_must_alloc(&fx, 1 + (size_t)(rand() % (16 * 1024)), 0);
  CHECK_EQ_U(CUR(cf_stats(&fx), SEGMENT, ALL), 1);
  /* Free in a scrambled order so that merging happens in every direction. */
  for (int i = 0; i < N; i += 2) CHECK(cp_free(fx.pool, p[i]) == CP_OK);
  for (int i = N - 1; i >= 0; i -= 2) CHECK(cp_free(fx.pool, p[i]) == CP_OK);
  cp_stats_t s = cf_stats(&fx);
  CHECK_EQ_U(CUR(s, INACTIVE_SPLIT, ALL), 0);
  CHECK_EQ_U(CUR(s, ACTIVE, ALL), 0);
  /* The segment is whole again; the first address comes back. */
  void *q = cf_must_alloc(&fx, 1 + (size_t)0, 0);
  CHECK(q == p[0]);
  CHECK(cp_free(fx.pool, q) == CP_OK);
  cf_close(&fx);
}

TEST(large_pool_split_rules) {
  cf_fixture_t fx;
  REQUIRE(open_kind(&fx, 1 * GiB, NULL, NULL) == 0);
  /* 1.5 MiB: a 20 MiB segment, the 18.5 MiB rest stays free (> 1 MiB). */
  void *a = cf_must_alloc(&fx, 1536 * KiB, 0);
  cp_stats_t s = cf_stats(&fx);
  CHECK_EQ_U(CUR(s, RESERVED_BYTES, LARGE), 20 * MiB);
  CHECK_EQ_U(CUR(s, ALLOCATED_BYTES, LARGE), 1536 * KiB);
  CHECK_EQ_U(CUR(s, INACTIVE_SPLIT_BYTES, LARGE), 20 * MiB - 1536 * KiB);
  /* 10 MiB: from here on one segment per request, rounded to 2 MiB. */
  void *b = cf_must_alloc(&fx, 10 * MiB, 0);
  s = cf_stats(&fx);
  CHECK_EQ_U(CUR(s, SEGMENT, LARGE), 1); /* fits the 18.5 MiB rest of the first segment */
  CHECK(cp_free(fx.pool, b) == CP_OK);
  void *c = cf_must_alloc(&fx, 19 * MiB, 0); /* 19 MiB does not fit in 18.5: new 20 MiB segment */
  s = cf_stats(&fx);
  CHECK_EQ_U(CUR(s, SEGMENT, LARGE), 2);
  CHECK_EQ_U(CUR(s, RESERVED_BYTES, LARGE), 40 * MiB);
  /* 1 MiB left over is not > 1 MiB: no split, the block keeps the whole 20 MiB. */
  CHECK_EQ_U(CUR(s, ALLOCATED_BYTES, LARGE), 1536 * KiB + 20 * MiB);
  CHECK(cp_free(fx.pool, c) == CP_OK);
  CHECK(cp_free(fx.pool, a) == CP_OK);
  CHECK(cp_empty_cache(fx.pool) == CP_OK);
  /* 10.5 MiB: a 12 MiB segment and a 1.5 MiB free rest. */
  void *d = cf_must_alloc(&fx, 10 * MiB + 512 * KiB, 0);
  s = cf_stats(&fx);
  CHECK_EQ_U(CUR(s, RESERVED_BYTES, LARGE), 12 * MiB);
  CHECK_EQ_U(CUR(s, INACTIVE_SPLIT_BYTES, LARGE), 1536 * KiB);
  CHECK(cp_free(fx.pool, d) == CP_OK);
  CHECK(cp_empty_cache(fx.pool) == CP_OK);
  /* 11 MiB: a 12 MiB segment, and the 1 MiB rest is not split off. */
  void *e = cf_must_alloc(&fx, 11 * MiB, 0);
  s = cf_stats(&fx);
  CHECK_EQ_U(CUR(s, ALLOCATED_BYTES, LARGE), 12 * MiB);
  CHECK_EQ_U(CUR(s, INACTIVE_SPLIT, LARGE), 0);
  CHECK(cp_free(fx.pool, e) == CP_OK);
  cf_close(&fx);
}

TEST(small_pool_split_rules) {
  cf_fixture_t fx;
  REQUIRE(open_kind(&fx, 64 * MiB, NULL, NULL) == 0);
  /* The small pool keeps any remainder of at least 512 bytes. */
  void *a = cf_must_alloc(&fx, 1 * MiB, 0); /* the largest small request */
  void *a2 = cf_must_alloc(&fx, 1 * MiB - 1024, 0);
  CHECK((uintptr_t)a2 == (uintptr_t)a + 1 * MiB);
  void *b = cf_must_alloc(&fx, 512, 0);
  CHECK((uintptr_t)b == (uintptr_t)a + 2 * MiB - 1024);
  void *c = cf_must_alloc(&fx, 512, 0); /* takes the last 512 bytes */
  CHECK((uintptr_t)c == (uintptr_t)b + 512);
  cp_stats_t s = cf_stats(&fx);
  CHECK_EQ_U(CUR(s, SEGMENT, SMALL), 1);
  CHECK_EQ_U(CUR(s, INACTIVE_SPLIT, SMALL), 0);
  CHECK(cp_free(fx.pool, a2) == CP_OK);
  s = cf_stats(&fx);
  CHECK_EQ_U(CUR(s, INACTIVE_SPLIT, SMALL), 1);
  a2 = cf_must_alloc(&fx, 1 * MiB - 1024, 0);
  CHECK(cp_free(fx.pool, b) == CP_OK);
  s = cf_stats(&fx);
  CHECK_EQ_U(CUR(s, INACTIVE_SPLIT, SMALL), 1);
  CHECK_EQ_U(CUR(s, INACTIVE_SPLIT_BYTES, SMALL), 512);
  CHECK(cp_free(fx.pool, a) == CP_OK);
  CHECK(cp_free(fx.pool, a2) == CP_OK); /* merges with a's and b's holes */
  s = cf_stats(&fx);
  CHECK_EQ_U(CUR(s, INACTIVE_SPLIT, SMALL), 1);
  CHECK_EQ_U(CUR(s, INACTIVE_SPLIT_BYTES, SMALL), 2 * MiB - 512);
  CHECK(cp_free(fx.pool, c) == CP_OK);
  s = cf_stats(&fx);
  CHECK_EQ_U(CUR(s, INACTIVE_SPLIT, SMALL), 0);
  cf_close(&fx);
}

TEST(max_split_size_rules) {
  cf_fixture_t fx;
  REQUIRE(open_kind(&fx, 1 * GiB, "max_split_size_mb:40", NULL) == 0);
  void *big = cf_must_alloc(&fx, 50 * MiB, 0);
  cp_stats_t s = cf_stats(&fx);
  CHECK(s.max_split_size == (int64_t)(40 * MiB));
  CHECK_EQ_U(s.oversize_allocations.current, 1);
  CHECK_EQ_U(s.oversize_segments.current, 1);
  CHECK(cp_free(fx.pool, big) == CP_OK);
  s = cf_stats(&fx);
  CHECK_EQ_U(s.oversize_allocations.current, 0);
  /* A request below max_split_size never takes an oversize block. */
  void *mid = cf_must_alloc(&fx, 30 * MiB, 0);
  CHECK(mid != big);
  CHECK_EQ_U(cf_stats(&fx).num_device_alloc, 2);
  /* An oversize request takes it when it is less than 20 MiB too large, unsplit. */
  void *o = cf_must_alloc(&fx, 45 * MiB, 0);
  CHECK(o == big);
  s = cf_stats(&fx);
  CHECK_EQ_U(s.num_device_alloc, 2);
  CHECK_EQ_U(CUR(s, ALLOCATED_BYTES, LARGE), 30 * MiB + 50 * MiB);
  CHECK(cp_free(fx.pool, o) == CP_OK);
  /* ... but not when it is 20 MiB or more too large. */
  void *o2 = cf_must_alloc(&fx, 41 * MiB, 0);
  CHECK(o2 == big); /* 50 - 42 = 8 MiB: fine */
  CHECK(cp_free(fx.pool, o2) == CP_OK);
  void *huge = cf_must_alloc(&fx, 80 * MiB, 0);
  CHECK(cp_free(fx.pool, huge) == CP_OK);
  CHECK(cp_free(fx.pool, mid) == CP_OK);
  uint64_t before = cf_stats(&fx).num_device_alloc;
  void *o3 = cf_must_alloc(&fx, 42 * MiB, 0); /* takes the 50, not the 80 (best fit) */
  CHECK(o3 == big);
  void *o4 = cf_must_alloc(&fx, 42 * MiB, 0); /* 80 >= 42 + 20: not taken, new segment */
  CHECK_EQ_U(cf_stats(&fx).num_device_alloc, before + 1);
  CHECK(cp_free(fx.pool, o3) == CP_OK);
  CHECK(cp_free(fx.pool, o4) == CP_OK);
  cf_close(&fx);
}

TEST(up_to_capacity_and_oom) {
  cf_fixture_t fx;
  REQUIRE(open_kind(&fx, 64 * MiB, NULL, NULL) == 0);
  /* Exactly the device; page-mapped, what whole 20 MiB chunks of it hold (three). */
  void *p = cf_must_alloc(&fx, g_paged ? 60 * MiB : 64 * MiB, 0);
  CHECK(cp_free(fx.pool, p) == CP_OK);
  void *q = NULL;
  CHECK(cp_alloc(fx.pool, 64 * MiB + 1, cf_stream(&fx, 0), &q) == CP_ERR_OOM);
  CHECK(q == NULL);
  CHECK(strstr(cp_last_error(), "Tried to allocate") != NULL);
  CHECK(strstr(cp_last_error(), "largest free block") != NULL);
  cp_stats_t s = cf_stats(&fx);
  CHECK_EQ_U(s.num_ooms, 1);
  CHECK_EQ_U(s.num_alloc_retries, 1);
  /* The cached memory went back on the retry. Stitching grows by what is missing in handles
   * of at most 20 MiB, so its last attempt maps three before the device refuses the fourth,
   * and those stay cached, free (as any page-mapped growth that fails midway leaves what it
   * mapped). */
  CHECK_EQ_U(CUR(s, RESERVED_BYTES, ALL), g_stitch ? 60 * MiB : 0);
  CHECK_EQ_U(CUR(s, ALLOCATED_BYTES, ALL), 0);
  CHECK_EQ_U(cf_device_used(&fx), g_stitch ? 60 * MiB : 0);
  CHECK_EQ_U(cp_pool_check(fx.pool, stderr), 0);
  /* Still usable, and a fitting request works. */
  void *r = cf_must_alloc(&fx, 32 * MiB, 0);
  CHECK(cp_free(fx.pool, r) == CP_OK);
  cf_close(&fx);
}

TEST(sizes_near_size_max) {
  cf_fixture_t fx;
  REQUIRE(open_kind(&fx, 64 * MiB, NULL, NULL) == 0);
  size_t sizes[] = {SIZE_MAX, SIZE_MAX - 1, SIZE_MAX - 511, SIZE_MAX / 2 + 1, (size_t)1 << 62};
  for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
    void *p = (void *)1;
    CHECK(cp_alloc(fx.pool, sizes[i], cf_stream(&fx, 0), &p) == CP_ERR_OOM);
    CHECK(p == (void *)1); /* untouched on failure */
  }
  CHECK_EQ_U(cf_stats(&fx).num_ooms, 5);
  void *q = cf_must_alloc(&fx, 100, 0);
  CHECK(cp_free(fx.pool, q) == CP_OK);
  cf_close(&fx);
}

TEST(retry_releases_cached_segments) {
  cf_fixture_t fx;
  REQUIRE(open_kind(&fx, 40 * MiB, NULL, NULL) == 0);
  /* Cached on another stream, so that it cannot serve the next request in either kind of
   * pool (page-mapped, the 30 MiB took two 20 MiB chunks, which would hold 32 MiB). */
  void *a = cf_must_alloc(&fx, 30 * MiB, 1);
  CHECK(cp_free(fx.pool, a) == CP_OK);
  void *b = cf_must_alloc(&fx, 32 * MiB, 0); /* cached + 32 > 40: retry after releasing */
  cp_stats_t s = cf_stats(&fx);
  CHECK_EQ_U(s.num_alloc_retries, 1);
  CHECK_EQ_U(s.num_ooms, 0);
  /* Page-mapped: one unmap of the free range; whole chunks. Stitching maps one handle of
   * exactly the 32 MiB, after the retry gave stream 1's 30 MiB handle back. */
  CHECK_EQ_U(s.num_device_free, 1);
  CHECK_EQ_U(CUR(s, RESERVED_BYTES, ALL), g_stitch ? 32 * MiB : g_paged ? 40 * MiB : 32 * MiB);
  CHECK(cp_free(fx.pool, b) == CP_OK);
  cf_close(&fx);
}

TEST(memory_cap_and_fraction) {
  cf_fixture_t fx;
  /* Page-mapped, the cap counts whole chunks: 2 MiB large chunks here, so that 14 MiB fit
   * under the 16 MiB cap as in a plain pool. */
  REQUIRE(open_kind(&fx, 256 * MiB, "memory_cap_mb:16", "min_large_alloc_mb:2,large_segment_mb:2") == 0);
  void *p = NULL;
  CHECK(cp_alloc(fx.pool, 20 * MiB, cf_stream(&fx, 0), &p) == CP_ERR_OOM);
  CHECK_EQ_U(grow_calls(&fx), 0); /* refused before the device */
  CHECK(strstr(cp_last_error(), "Memory cap: 16.00 MiB") != NULL);
  void *a = cf_must_alloc(&fx, 14 * MiB, 0);
  CHECK(cp_free(fx.pool, a) == CP_OK);
  CHECK(cp_pool_set_memory_cap(fx.pool, 0) == CP_OK);
  void *b = cf_must_alloc(&fx, 20 * MiB, 0);
  CHECK(cp_free(fx.pool, b) == CP_OK);
  CHECK(cp_empty_cache(fx.pool) == CP_OK);
  CHECK(cp_pool_set_memory_fraction(fx.pool, 0.25) == CP_OK); /* 64 MiB */
  void *c = cf_must_alloc(&fx, 64 * MiB, 0);
  CHECK(cp_alloc(fx.pool, 2 * MiB, cf_stream(&fx, 0), &p) == CP_ERR_OOM);
  CHECK(cp_free(fx.pool, c) == CP_OK);
  CHECK(cp_pool_set_memory_fraction(fx.pool, 1.5) == CP_ERR_INVALID);
  CHECK(cp_pool_set_memory_fraction(fx.pool, -0.1) == CP_ERR_INVALID);
  cp_pool_info_t info;
  cp_pool_info(fx.pool, &info);
  CHECK_EQ_U(info.memory_cap, 64 * MiB);
  cf_close(&fx);
}

TEST(empty_cache_returns_free_segments_only) {
  cf_fixture_t fx;
  REQUIRE(open_kind(&fx, 256 * MiB, NULL, NULL) == 0);
  void *live = cf_must_alloc(&fx, 4096, 0);
  void *a = cf_must_alloc(&fx, 3 * MiB, 0);
  void *b = cf_must_alloc(&fx, 18 * MiB, 0); /* does not fit the 17 MiB rest: own segment */
  CHECK(cp_free(fx.pool, a) == CP_OK);
  CHECK(cp_free(fx.pool, b) == CP_OK);
  CHECK(cp_empty_cache(fx.pool) == CP_OK);
  cp_stats_t s = cf_stats(&fx);
  CHECK_EQ_U(CUR(s, RESERVED_BYTES, ALL), 2 * MiB); /* the live block's segment stays */
  CHECK_EQ_U(cf_device_used(&fx), 2 * MiB);
  /* Page-mapped: a and b share one range of two chunks, unmapped in one call. */
  CHECK_EQ_U(s.num_device_free, g_paged ? 1 : 2);
  CHECK(cp_free(fx.pool, live) == CP_OK);
  CHECK(cp_empty_cache(fx.pool) == CP_OK);
  CHECK_EQ_U(cf_device_used(&fx), 0);
  cf_close(&fx);
}

TEST(garbage_collection_threshold) {
  cf_fixture_t fx;
  REQUIRE(open_kind(&fx, 100 * MiB, "garbage_collection_threshold:0.5", NULL) == 0);
  void *a = cf_must_alloc(&fx, 30 * MiB, 0);
  CHECK(cp_free(fx.pool, a) == CP_OK);
  void *b = cf_must_alloc(&fx, 32 * MiB, 0); /* 30 + 32 > 50: the cached 30 goes first */
  cp_stats_t s = cf_stats(&fx);
  CHECK_EQ_U(s.num_device_free, 1);
  CHECK_EQ_U(s.num_alloc_retries, 0);
  CHECK(cp_free(fx.pool, b) == CP_OK);
  cf_close(&fx);
}

TEST(release_before_grow) {
  cf_fixture_t fx;
  REQUIRE(open_kind(&fx, 1 * GiB, "release_before_grow:True", NULL) == 0);
  void *a = cf_must_alloc(&fx, 30 * MiB, 0);
  void *keep = cf_must_alloc(&fx, 4096, 0);
  CHECK(cp_free(fx.pool, a) == CP_OK);
  CHECK_EQ_U(CUR(cf_stats(&fx), RESERVED_BYTES, ALL), 30 * MiB + 2 * MiB); /* cached */
  void *b = cf_must_alloc(&fx, 12 * MiB, 1); /* another stream: a's free segment goes first */
  cp_stats_t s = cf_stats(&fx);
  CHECK_EQ_U(s.num_device_free, 1);
  CHECK_EQ_U(s.num_alloc_retries, 0);
  CHECK_EQ_U(CUR(s, RESERVED_BYTES, ALL), 12 * MiB + 2 * MiB); /* the live small one stays */
  void *c = cf_must_alloc(&fx, 4 * MiB, 1);                    /* a 20 MiB segment; nothing to give back */
  CHECK_EQ_U(cf_stats(&fx).num_device_free, 1);
  CHECK(cp_free(fx.pool, b) == CP_OK);
  void *d = cf_must_alloc(&fx, 10 * MiB, 1); /* best fit: b's 12, not c's 16 MiB rest */
  CHECK(d == b);
  CHECK_EQ_U(cf_stats(&fx).num_device_free, 1);
  CHECK(cp_free(fx.pool, c) == CP_OK);
  CHECK(cp_free(fx.pool, d) == CP_OK);
  CHECK(cp_free(fx.pool, keep) == CP_OK);
  cf_close(&fx);
}

TEST(release_before_grow_keeps_cache_below_high_water) {
  cf_fixture_t fx;
  REQUIRE(open_kind(&fx, 1 * GiB, "release_before_grow:True", NULL) == 0);
  void *x = cf_must_alloc(&fx, 40 * MiB, 0); /* high-water mark: 40 MiB */
  CHECK(cp_free(fx.pool, x) == CP_OK);
  void *y = cf_must_alloc(&fx, 30 * MiB, 1); /* 40 + 30 > 40: x's segment goes */
  cp_stats_t s = cf_stats(&fx);
  CHECK_EQ_U(s.num_device_free, 1);
  CHECK_EQ_U(CUR(s, RESERVED_BYTES, ALL), 30 * MiB);
  CHECK(cp_free(fx.pool, y) == CP_OK);
  void *z = cf_must_alloc(&fx, 1000, 2); /* 30 + 2 <= 40: the cache stays */
  s = cf_stats(&fx);
  CHECK_EQ_U(s.num_device_free, 1);
  CHECK_EQ_U(CUR(s, RESERVED_BYTES, ALL), 32 * MiB);
  void *w = cf_must_alloc(&fx, 12 * MiB, 3); /* 32 + 12 > 40: the oldest free segment (y's) goes */
  s = cf_stats(&fx);
  CHECK_EQ_U(s.num_device_free, 2);
  CHECK_EQ_U(CUR(s, RESERVED_BYTES, ALL), 2 * MiB + 12 * MiB);
  CHECK(cp_free(fx.pool, z) == CP_OK);
  CHECK(cp_free(fx.pool, w) == CP_OK);
  cf_close(&fx);
}

TEST(live_ranges_never_overlap) {
  cf_fixture_t fx;
  REQUIRE(open_kind(&fx, 512 * MiB, NULL, NULL) == 0);
  enum { SLOTS = 200 };
  uintptr_t addr[SLOTS] = {0};
  size_t len[SLOTS] = {0};
  srand(11);
  for (int op = 0; op < 4000; op++) {
    int i = rand() % SLOTS;
    if (addr[i] != 0) {
      /* The block still holds its pattern: nobody else wrote into it (on the simulated device,
       * whose memory is the host's; the stand-in's is not). */
      unsigned char *m = (unsigned char *)addr[i];
      if (!g_cuda) CHECK(m[0] == (unsigned char)i && m[len[i] - 1] == (unsigned char)(i ^ 0x5a));
      CHECK(cp_free(fx.pool, (void *)addr[i]) == CP_OK);
      addr[i] = 0;
      continue;
    }
    size_t size = (rand() % 8 == 0) ? 1 + (size_t)(rand() % (24 * (int)MiB)) : 1 + (size_t)(rand() % 200000);
    void *p = NULL;
    if (cp_alloc(fx.pool, size, cf_stream(&fx, (cp_stream_t)(rand() % 3)), &p) != CP_OK) continue;
    uintptr_t a = (uintptr_t)p;
    CHECK(a % 512 == 0);
    for (int j = 0; j < SLOTS; j++) {
      if (addr[j] != 0) CHECK(a + size <= addr[j] || addr[j] + len[j] <= a);
    }
    addr[i] = a;
    len[i] = size;
    if (g_cuda) continue;
    ((unsigned char *)p)[0] = (unsigned char)i;
    ((unsigned char *)p)[size - 1] = (unsigned char)(i ^ 0x5a);
  }
  for (int i = 0; i < SLOTS; i++) CHECK(cp_free(fx.pool, (void *)addr[i]) == CP_OK);
  cp_stats_t s = cf_stats(&fx);
  CHECK_EQ_U(CUR(s, ALLOCATED_BYTES, ALL), 0);
  CHECK_EQ_U(CUR(s, ACTIVE_BYTES, ALL), 0);
  cf_close(&fx);
}

TEST(blocks_stay_on_their_stream) {
  cf_fixture_t fx;
  REQUIRE(open_kind(&fx, 512 * MiB, NULL, NULL) == 0);
  void *a = cf_must_alloc(&fx, 8192, 1);
  CHECK(cp_free(fx.pool, a) == CP_OK);
  void *b = cf_must_alloc(&fx, 8192, 2); /* stream 2 never gets stream 1's block */
  CHECK(b != a);
  cp_stats_t s = cf_stats(&fx);
  if (g_paged) { /* one range per (stream, kind); the segment stat counts plain segments only */
    cp_pool_info_t in;
    cp_pool_info(fx.pool, &in);
    CHECK_EQ_U(in.page_segments, 2);
    CHECK_EQ_U(CUR(s, SEGMENT, SMALL), 0);
  } else {
    CHECK_EQ_U(CUR(s, SEGMENT, SMALL), 2);
  }
  void *c = cf_must_alloc(&fx, 8192, 1);
  CHECK(c == a);
  CHECK(cp_free(fx.pool, b) == CP_OK);
  CHECK(cp_free(fx.pool, c) == CP_OK);
  /* Many streams, each its own segments, none crossing over. */
  void *per[16];
  for (int i = 0; i < 16; i++) per[i] = cf_must_alloc(&fx, 3 * MiB, (cp_stream_t)(100 + i));
  for (int i = 0; i < 16; i++) CHECK(cp_free(fx.pool, per[i]) == CP_OK);
  for (int i = 0; i < 16; i++) {
    void *p = cf_must_alloc(&fx, 3 * MiB, (cp_stream_t)(100 + i));
    CHECK(p == per[i]);
    CHECK(cp_free(fx.pool, p) == CP_OK);
  }
  CHECK_EQ_U(cf_calls(&fx, CP_SIM_EVENT_RECORD), 0); /* plain frees record nothing */
  cf_close(&fx);
}

TEST(record_stream_waits_for_event) {
  cf_fixture_t fx;
  REQUIRE(open_kind(&fx, 256 * MiB, NULL, NULL) == 0);
  void *p = cf_must_alloc(&fx, 1000, 1);
  CHECK(cp_record_stream(fx.pool, p, cf_stream(&fx, 1)) == CP_OK);
  cf_launch(&fx, 1, p, 1); /* its own stream: nothing to do */
  CHECK(cp_record_stream(fx.pool, p, cf_stream(&fx, 2)) == CP_OK);
  cf_launch(&fx, 2, p, 1);
  CHECK(cp_record_stream(fx.pool, p, cf_stream(&fx, 2)) == CP_OK);
  cf_launch(&fx, 2, p, 1); /* twice: one event */
  CHECK(cp_free(fx.pool, p) == CP_OK);
  CHECK_EQ_U(cf_calls(&fx, CP_SIM_EVENT_RECORD), 1);
  cp_stats_t s = cf_stats(&fx);
  CHECK_EQ_U(CUR(s, ALLOCATION, ALL), 0);
  CHECK_EQ_U(CUR(s, ACTIVE, ALL), 1); /* still active until stream 2 is done */
  CHECK_EQ_U(CUR(s, REQUESTED_BYTES, ALL), 1000);
  for (int i = 0; i < 10; i++) { /* busy stream 2: p is not handed out */
    void *q = cf_must_alloc(&fx, 1000, 1);
    CHECK(q != p);
    CHECK(cp_free(fx.pool, q) == CP_OK);
  }
  cp_pool_info_t info;
  cp_pool_info(fx.pool, &info);
  CHECK_EQ_U(info.pending_blocks, 1);
  CHECK_EQ_U(info.pending_free, 1024);
  cf_complete(&fx, 3); /* another stream finishing changes nothing */
  void *q = cf_must_alloc(&fx, 1000, 1);
  CHECK(q != p);
  CHECK(cp_free(fx.pool, q) == CP_OK);
  cf_complete(&fx, 2);
  void *r = cf_must_alloc(&fx, 1000, 1);
  CHECK(r == p);
  s = cf_stats(&fx);
  CHECK_EQ_U(CUR(s, ACTIVE, ALL), 1);
  CHECK(cp_free(fx.pool, r) == CP_OK);
  CHECK_EQ_U(cf_calls(&fx, CP_SIM_EVENT_RECORD), 1); /* the plain free recorded none */
  cf_close(&fx);
}

TEST(record_stream_many_streams_and_event_pooling) {
  cf_fixture_t fx;
  REQUIRE(open_kind(&fx, 256 * MiB, NULL, NULL) == 0);
  for (int round = 0; round < 50; round++) {
    void *p = cf_must_alloc(&fx, 64 * KiB, 0);
    for (cp_stream_t s = 1; s <= 3; s++) {
      CHECK(cp_record_stream(fx.pool, p, cf_stream(&fx, s)) == CP_OK);
      cf_launch(&fx, s, p, 1);
    }
    CHECK(cp_free(fx.pool, p) == CP_OK);
    cf_complete(&fx, 1);
    cf_complete(&fx, 2);
    void *q = cf_must_alloc(&fx, 64 * KiB, 0); /* stream 3 still busy */
    CHECK(q != p);
    CHECK(cp_free(fx.pool, q) == CP_OK);
    cf_complete(&fx, 3);
    void *r = cf_must_alloc(&fx, 64 * KiB, 0);
    CHECK(r == p);
    CHECK(cp_free(fx.pool, r) == CP_OK);
  }
  CHECK_EQ_U(cf_calls(&fx, CP_SIM_EVENT_RECORD), 150);
  CHECK(cf_calls(&fx, CP_SIM_EVENT_CREATE) <= 3); /* events are reused */
  cf_close(&fx);
}

TEST(empty_cache_waits_for_pending) {
  cf_fixture_t fx;
  REQUIRE(open_kind(&fx, 256 * MiB, NULL, NULL) == 0);
  void *p = cf_must_alloc(&fx, 5 * MiB, 0);
  CHECK(cp_record_stream(fx.pool, p, cf_stream(&fx, 9)) == CP_OK);
  cf_launch(&fx, 9, p, 1);
  CHECK(cp_free(fx.pool, p) == CP_OK);
  CHECK(cp_empty_cache(fx.pool) == CP_OK);
  if (g_paged) {
    /* Page-mapped: empty_cache waits for nothing (Note [Stream-ordered release]); the block
     * stays pending, and its memory reserved, until stream 9 is done. */
    CHECK_EQ_U(cf_calls(&fx, CP_SIM_EVENT_SYNCHRONIZE), 0);
    CHECK_EQ_U(cf_stats(&fx).num_sync_all_streams, 0);
    CHECK(cf_device_used(&fx) != 0);
    CHECK_EQ_U(cf_info(&fx).pending_blocks, 1);
    cf_complete(&fx, 9);
    CHECK(cp_empty_cache(fx.pool) == CP_OK); /* the stream is idle: its drain event is done */
    CHECK_EQ_U(cf_calls(&fx, CP_SIM_EVENT_SYNCHRONIZE), 0);
  } else {
    /* As the built-in allocator: it waits for the pending free, cudaFree for the device. */
    CHECK_EQ_U(cf_calls(&fx, CP_SIM_EVENT_SYNCHRONIZE), 1);
    CHECK_EQ_U(cf_stats(&fx).num_sync_all_streams, 1);
  }
  CHECK_EQ_U(cf_device_used(&fx), 0);
  cf_close(&fx);
}

TEST(oom_retry_waits_for_pending) {
  cf_fixture_t fx;
  REQUIRE(open_kind(&fx, 40 * MiB, NULL, NULL) == 0);
  void *p = cf_must_alloc(&fx, 30 * MiB, 0);
  CHECK(cp_record_stream(fx.pool, p, cf_stream(&fx, 5)) == CP_OK);
  cf_launch(&fx, 5, p, 1);
  CHECK(cp_free(fx.pool, p) == CP_OK);
  void *q = cf_must_alloc(&fx, 32 * MiB, 0); /* needs p's segment back: wait, release, grow */
  cp_stats_t s = cf_stats(&fx);
  CHECK_EQ_U(s.num_alloc_retries, 1);
  CHECK_EQ_U(s.num_ooms, 0);
  CHECK(cp_free(fx.pool, q) == CP_OK);
  cf_close(&fx);
}

TEST(bad_pointers) {
  cf_fixture_t fx;
  REQUIRE(open_kind(&fx, 64 * MiB, NULL, NULL) == 0);
  void *p = cf_must_alloc(&fx, 4096, 0);
  cp_stats_t before = cf_stats(&fx);
  int local;
  CHECK(cp_free(fx.pool, &local) == CP_ERR_INVALID);
  CHECK(strstr(cp_last_error(), "not allocated by this pool") != NULL);
  CHECK(cp_free(fx.pool, (char *)p + 512) == CP_ERR_INVALID); /* interior pointer */
  CHECK(cp_record_stream(fx.pool, &local, cf_stream(&fx, 3)) == CP_ERR_INVALID);
  CHECK(cp_record_stream(fx.pool, NULL, cf_stream(&fx, 3)) == CP_ERR_INVALID);
  cp_stats_t after = cf_stats(&fx);
  CHECK(memcmp(&before, &after, sizeof before) == 0);
  CHECK(cp_free(fx.pool, p) == CP_OK);
  CHECK(cp_free(fx.pool, p) == CP_ERR_INVALID);                             /* double free */
  CHECK(cp_record_stream(fx.pool, p, cf_stream(&fx, 3)) == CP_ERR_INVALID); /* after free */
  cf_close(&fx);
}

TEST(stats_resets) {
  cf_fixture_t fx;
  REQUIRE(open_kind(&fx, 64 * MiB, NULL, NULL) == 0);
  void *a = cf_must_alloc(&fx, 100 * KiB, 0);
  void *b = cf_must_alloc(&fx, 100 * KiB, 0);
  CHECK(cp_free(fx.pool, a) == CP_OK);
  cp_pool_reset_peak_stats(fx.pool);
  cp_stats_t s = cf_stats(&fx);
  CHECK_EQ_U(PEAK(s, ALLOCATED_BYTES, ALL), 100 * KiB);
  /* Stitching: one range per stream serves every size, all counted in the large class. */
  CHECK_EQ_U(PEAK(s, ALLOCATION, SMALL), g_stitch ? 0 : 1);
  CHECK_EQ_U(PEAK(s, ALLOCATION, LARGE), g_stitch ? 1 : 0);
  cp_pool_reset_accumulated_stats(fx.pool);
  s = cf_stats(&fx);
  CHECK_EQ_U(s.family[CP_STAT_ALLOCATION][CP_KIND_ALL].allocated, 0);
  CHECK_EQ_U(s.family[CP_STAT_ALLOCATION][CP_KIND_ALL].freed, 0);
  CHECK_EQ_U(s.num_device_alloc, 0);
  CHECK_EQ_U(CUR(s, ALLOCATION, ALL), 1); /* current is never reset */
  CHECK(cp_free(fx.pool, b) == CP_OK);
  s = cf_stats(&fx);
  CHECK_EQ_U(s.family[CP_STAT_ALLOCATION][CP_KIND_ALL].freed, 1);
  cf_close(&fx);
}

TEST(backend_failures_leave_pool_whole) {
  if (cf_skip_on_cuda("backend_failures_leave_pool_whole",
                      "fails calls with the simulator's injection; test_cuda_standin.c's injected_failures_are_named "
                      "fails each driver call"))
    return;
  cf_fixture_t fx;
  REQUIRE(open_kind(&fx, 256 * MiB, NULL, NULL) == 0);
  void *p = NULL;
  cp_sim_fail_nth(fx.sim, CP_SIM_RESERVE, 1, CP_ERR_BACKEND);
  CHECK(cp_alloc(fx.pool, 4096, cf_stream(&fx, 0), &p) == CP_ERR_BACKEND);
  CHECK(strstr(cp_last_error(), "injected") != NULL);
  CHECK_EQ_U(cp_pool_check(fx.pool, stderr), 0);
  void *a = cf_must_alloc(&fx, 4096, 0);
  /* An event that cannot be recorded: the free fails and the block stays live. */
  CHECK(cp_record_stream(fx.pool, a, cf_stream(&fx, 4)) == CP_OK);
  cf_launch(&fx, 4, a, 1);
  cp_sim_fail_nth(fx.sim, CP_SIM_EVENT_RECORD, 1, CP_ERR_BACKEND);
  CHECK(cp_free(fx.pool, a) == CP_ERR_BACKEND);
  cp_stats_t s = cf_stats(&fx);
  CHECK_EQ_U(CUR(s, ALLOCATION, ALL), 1);
  CHECK_EQ_U(cp_pool_check(fx.pool, stderr), 0);
  CHECK(cp_free(fx.pool, a) == CP_OK);
  /* A release the device refuses keeps the segment in the pool. */
  cf_complete_all(&fx);
  cp_sim_fail_nth(fx.sim, CP_SIM_RELEASE, 1, CP_ERR_BACKEND);
  CHECK(cp_empty_cache(fx.pool) == CP_ERR_BACKEND);
  CHECK_EQ_U(CUR(cf_stats(&fx), SEGMENT, ALL), 1);
  CHECK_EQ_U(cp_pool_check(fx.pool, stderr), 0);
  CHECK(cp_empty_cache(fx.pool) == CP_OK);
  CHECK_EQ_U(CUR(cf_stats(&fx), SEGMENT, ALL), 0);
  /* An OOM from the device (not the cap) ends in the same report. */
  cp_sim_fail_nth(fx.sim, CP_SIM_RESERVE, 1, CP_ERR_OOM);
  cp_sim_fail_nth(fx.sim, CP_SIM_RESERVE, 1, CP_ERR_OOM);
  void *b = cf_must_alloc(&fx, 4096, 0); /* first try fails, the retry succeeds */
  CHECK_EQ_U(cf_stats(&fx).num_alloc_retries, 1);
  CHECK(cp_free(fx.pool, b) == CP_OK);
  cf_close(&fx);
}

TEST(info_and_report) {
  cf_fixture_t fx;
  REQUIRE(open_kind(&fx, 64 * MiB, NULL, NULL) == 0);
  void *a = cf_must_alloc(&fx, 3 * MiB, 0);
  void *b = cf_must_alloc(&fx, 3 * MiB, 0);
  void *c = cf_must_alloc(&fx, 3 * MiB, 0);
  CHECK(cp_free(fx.pool, b) == CP_OK);
  cp_pool_info_t in;
  cp_pool_info(fx.pool, &in);
  CHECK_EQ_U(in.reserved, 20 * MiB);
  CHECK_EQ_U(in.allocated, 6 * MiB);
  CHECK_EQ_U(in.cached_free, 14 * MiB);
  CHECK_EQ_U(in.largest_free_block, 11 * MiB);
  CHECK_EQ_U(in.free_blocks, 2);
  CHECK_EQ_U(in.live_blocks, 2);
  CHECK_EQ_U(in.device_total, 64 * MiB);
  char buf[2048];
  int n = cp_pool_oom_report(fx.pool, 12 * MiB, buf, sizeof buf);
  CHECK(n > 0 && (size_t)n < sizeof buf);
  CHECK(strstr(buf, "Tried to allocate 12.00 MiB") != NULL);
  CHECK(strstr(buf, "fragmented") != NULL); /* 14 MiB cached, no 12 MiB block */
  CHECK(cp_free(fx.pool, a) == CP_OK);
  CHECK(cp_free(fx.pool, c) == CP_OK);
  cf_close(&fx);
}

/* The pass a failure came from: the backend and the pool kind. */
static const char *cf_pass(void) {
  return g_cuda ? (g_paged ? (g_stitch ? "cuda, " STITCH_CONF : "cuda, " PAGED_CONF) : "cuda, plain segments")
                : (g_paged ? (g_stitch ? "sim, " STITCH_CONF : "sim, " PAGED_CONF) : "sim, plain segments");
}

/* RUN, saying which pass a failure came from, and counting the cases the pass ran. */
static int g_pass_cases = 0;
#define RUN_CF(name)                                                                        \
  do {                                                                                      \
    int failed_ = check_tests_failed_, ran_ = check_tests_passed_ + check_tests_failed_;    \
    RUN(name);                                                                              \
    if (check_tests_failed_ != failed_) fprintf(stderr, "  (the pass on %s)\n", cf_pass()); \
    g_pass_cases += check_tests_passed_ + check_tests_failed_ - ran_;                       \
  } while (0)

/* The checks that hold for every kind of pool, as page-mapped pools run them. */
static void cf_paged_checks(void) {
  RUN_CF(size_zero);
  RUN_CF(cached_block_reused_without_reserve);
  RUN_CF(up_to_capacity_and_oom);
  RUN_CF(sizes_near_size_max);
  RUN_CF(retry_releases_cached_segments);
  RUN_CF(memory_cap_and_fraction);
  RUN_CF(empty_cache_returns_free_segments_only);
  RUN_CF(live_ranges_never_overlap);
  RUN_CF(blocks_stay_on_their_stream);
  RUN_CF(record_stream_waits_for_event);
  RUN_CF(record_stream_many_streams_and_event_pooling);
  RUN_CF(empty_cache_waits_for_pending);
  RUN_CF(oom_retry_waits_for_pending);
  RUN_CF(bad_pointers);
  RUN_CF(stats_resets);
}

static void cf_plain_checks(void) {
  RUN_CF(size_zero);
  RUN_CF(small_request_stats);
  RUN_CF(rounding);
  RUN_CF(cached_block_reused_without_reserve);
  RUN_CF(first_address_back_after_coalescing);
  RUN_CF(large_pool_split_rules);
  RUN_CF(small_pool_split_rules);
  RUN_CF(max_split_size_rules);
  RUN_CF(up_to_capacity_and_oom);
  RUN_CF(sizes_near_size_max);
  RUN_CF(retry_releases_cached_segments);
  RUN_CF(memory_cap_and_fraction);
  RUN_CF(empty_cache_returns_free_segments_only);
  RUN_CF(garbage_collection_threshold);
  RUN_CF(release_before_grow);
  RUN_CF(release_before_grow_keeps_cache_below_high_water);
  RUN_CF(live_ranges_never_overlap);
  RUN_CF(blocks_stay_on_their_stream);
  RUN_CF(record_stream_waits_for_event);
  RUN_CF(record_stream_many_streams_and_event_pooling);
  RUN_CF(empty_cache_waits_for_pending);
  RUN_CF(oom_retry_waits_for_pending);
  RUN_CF(bad_pointers);
  RUN_CF(stats_resets);
  RUN_CF(backend_failures_leave_pool_whole);
  RUN_CF(info_and_report);
}

/* The whole suite on one backend (`cuda`: the CUDA backend on the stand-in g_sa, opened by the
 * caller): plain segments, then page-mapped segments, then page-mapped segments that stitch;
 * one line per pass with the cases it ran. */
static void cf_suite(int cuda) {
  g_cuda = cuda;
  for (int pass = 0; pass < 3; pass++) {
    g_paged = pass > 0;
    g_stitch = pass > 1;
    g_pass_cases = 0;
    const int skipped = g_skipped;
    if (pass == 0)
      cf_plain_checks();
    else
      cf_paged_checks();
    printf("conformance on %s: %d cases run, %d skipped\n", cf_pass(), g_pass_cases - (g_skipped - skipped),
           g_skipped - skipped);
  }
  g_paged = g_stitch = 0;
}

#endif /* CP_TEST_CONFORMANCE_H */
