/* test_pool.c — conformance of the pool on the simulated device: sizes, splitting, reuse,
 * the OOM ladder, the cap, empty_cache, stream ordering, statistics and bad input. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/sim.h"
#include "check.h"
#include "core/cp.h"
#include "fixture.h"

#define CUR(s, fam, kind)  ((s).family[CP_STAT_##fam][CP_KIND_##kind].current)
#define PEAK(s, fam, kind) ((s).family[CP_STAT_##fam][CP_KIND_##kind].peak)

/* The conformance checks that hold for every kind of pool run three times (main): over plain
 * segments, over page-mapped ones (PAGED_CONF, core/expand.c) and over page-mapped ones that
 * stitch (STITCH_CONF, core/stitch.c). Where the kinds differ by design (a page-mapped pool
 * maps whole chunks of one range per stream and kind, counts no segments in the segment stat,
 * unmaps a free range in one call; a stitching pool maps one page at a time, of one range per
 * stream for every size), the expectation depends on g_paged / g_stitch and says why. */
#define PAGED_CONF  "expandable_segments:True"
#define STITCH_CONF "expandable_segments:True,page_stitching:True"
static int g_paged = 0;
static int g_stitch = 0; /* with g_paged */

/* fx_open with the pool kind of this pass; `paged_extra` is added for page-mapped pools. */
static int open_kind(fixture_t *fx, size_t capacity, const char *conf, const char *paged_extra) {
  char text[512];
  snprintf(text, sizeof text, "%s%s%s%s%s", conf != NULL ? conf : "", conf != NULL && g_paged ? "," : "",
           g_paged ? (g_stitch ? STITCH_CONF : PAGED_CONF) : "", g_paged && paged_extra != NULL ? "," : "",
           g_paged && paged_extra != NULL ? paged_extra : "");
  if (fx_open(fx, capacity, text) != 0) return -1;
  cp_pool_info_t in;
  cp_pool_info(fx->pool, &in);
  return in.page_mapped == g_paged ? 0 : -1;
}

/* The device calls that grow a pool: a plain reservation, or a page for a page-mapped chunk. */
static uint64_t grow_calls(fixture_t *fx) {
  return cp_sim_calls(fx->sim, g_paged ? CP_SIM_PAGE_CREATE : CP_SIM_RESERVE);
}

TEST(size_zero) {
  fixture_t fx;
  REQUIRE(open_kind(&fx, 64 * MiB, NULL, NULL) == 0);
  void *p = (void *)1;
  CHECK(cp_alloc(fx.pool, 0, 0, &p) == CP_OK);
  CHECK(p == NULL);
  CHECK(cp_free(fx.pool, NULL) == CP_OK);
  cp_stats_t s = stats_of(&fx);
  CHECK_EQ_U(CUR(s, ALLOCATION, ALL), 0);
  CHECK_EQ_U(grow_calls(&fx), 0);
  fx_close(&fx);
}

TEST(small_request_stats) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 64 * MiB, NULL) == 0);
  void *p = must_alloc(&fx, 1000, 0);
  CHECK((uintptr_t)p % 512 == 0);
  cp_stats_t s = stats_of(&fx);
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
  s = stats_of(&fx);
  CHECK_EQ_U(CUR(s, ALLOCATION, ALL), 0);
  CHECK_EQ_U(CUR(s, ALLOCATED_BYTES, ALL), 0);
  CHECK_EQ_U(CUR(s, ACTIVE, ALL), 0);
  CHECK_EQ_U(CUR(s, REQUESTED_BYTES, ALL), 0);
  CHECK_EQ_U(CUR(s, INACTIVE_SPLIT, ALL), 0);       /* merged back into one whole segment */
  CHECK_EQ_U(CUR(s, RESERVED_BYTES, ALL), 2 * MiB); /* cached, not returned */
  CHECK_EQ_U(PEAK(s, ALLOCATED_BYTES, ALL), 1024);
  CHECK_EQ_U(s.family[CP_STAT_ALLOCATION][CP_KIND_ALL].allocated, 1);
  CHECK_EQ_U(s.family[CP_STAT_ALLOCATION][CP_KIND_ALL].freed, 1);
  fx_close(&fx);
}

TEST(rounding) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 64 * MiB, NULL) == 0);
  size_t sizes[] = {1, 511, 512, 513, 1 * MiB, 1 * MiB + 1};
  size_t expect[] = {512, 512, 512, 1024, 1 * MiB, 1 * MiB + 512};
  for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
    void *p = must_alloc(&fx, sizes[i], 0);
    cp_stats_t s = stats_of(&fx);
    CHECK_EQ_U(CUR(s, ALLOCATED_BYTES, ALL), expect[i]);
    CHECK(cp_free(fx.pool, p) == CP_OK);
  }
  cp_stats_t s = stats_of(&fx);
  CHECK_EQ_U(CUR(s, SEGMENT, SMALL), 1); /* 1 MiB is still small */
  CHECK_EQ_U(CUR(s, SEGMENT, LARGE), 1); /* 1 MiB + 1 is large: one 20 MiB segment */
  CHECK_EQ_U(CUR(s, RESERVED_BYTES, LARGE), 20 * MiB);
  fx_close(&fx);
}

TEST(cached_block_reused_without_reserve) {
  fixture_t fx;
  REQUIRE(open_kind(&fx, 256 * MiB, NULL, NULL) == 0);
  size_t sizes[] = {4096, 700 * KiB, 3 * MiB, 15 * MiB};
  for (size_t i = 0; i < 4; i++) {
    void *first = must_alloc(&fx, sizes[i], 0);
    CHECK(cp_free(fx.pool, first) == CP_OK);
    uint64_t reserves = grow_calls(&fx);
    for (int k = 0; k < 100; k++) {
      void *p = must_alloc(&fx, sizes[i], 0);
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
  fx_close(&fx);
}

TEST(first_address_back_after_coalescing) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 256 * MiB, NULL) == 0);
  enum { N = 120 };
  void *p[N];
  srand(7);
  /* At most 120 x 16 KiB: everything comes from one 2 MiB segment. */
  for (int i = 0; i < N; i++) p[i] = must_alloc(&fx, 1 + (size_t)(rand() % (16 * 1024)), 0);
  CHECK_EQ_U(CUR(stats_of(&fx), SEGMENT, ALL), 1);
  /* Free in a scrambled order so that merging happens in every direction. */
  for (int i = 0; i < N; i += 2) CHECK(cp_free(fx.pool, p[i]) == CP_OK);
  for (int i = N - 1; i >= 0; i -= 2) CHECK(cp_free(fx.pool, p[i]) == CP_OK);
  cp_stats_t s = stats_of(&fx);
  CHECK_EQ_U(CUR(s, INACTIVE_SPLIT, ALL), 0);
  CHECK_EQ_U(CUR(s, ACTIVE, ALL), 0);
  /* The segment is whole again; the first address comes back. */
  void *q = must_alloc(&fx, 1 + (size_t)0, 0);
  CHECK(q == p[0]);
  CHECK(cp_free(fx.pool, q) == CP_OK);
  fx_close(&fx);
}

TEST(large_pool_split_rules) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 1 * GiB, NULL) == 0);
  /* 1.5 MiB: a 20 MiB segment, the 18.5 MiB rest stays free (> 1 MiB). */
  void *a = must_alloc(&fx, 1536 * KiB, 0);
  cp_stats_t s = stats_of(&fx);
  CHECK_EQ_U(CUR(s, RESERVED_BYTES, LARGE), 20 * MiB);
  CHECK_EQ_U(CUR(s, ALLOCATED_BYTES, LARGE), 1536 * KiB);
  CHECK_EQ_U(CUR(s, INACTIVE_SPLIT_BYTES, LARGE), 20 * MiB - 1536 * KiB);
  /* 10 MiB: from here on one segment per request, rounded to 2 MiB. */
  void *b = must_alloc(&fx, 10 * MiB, 0);
  s = stats_of(&fx);
  CHECK_EQ_U(CUR(s, SEGMENT, LARGE), 1); /* fits the 18.5 MiB rest of the first segment */
  CHECK(cp_free(fx.pool, b) == CP_OK);
  void *c = must_alloc(&fx, 19 * MiB, 0); /* 19 MiB does not fit in 18.5: new 20 MiB segment */
  s = stats_of(&fx);
  CHECK_EQ_U(CUR(s, SEGMENT, LARGE), 2);
  CHECK_EQ_U(CUR(s, RESERVED_BYTES, LARGE), 40 * MiB);
  /* 1 MiB left over is not > 1 MiB: no split, the block keeps the whole 20 MiB. */
  CHECK_EQ_U(CUR(s, ALLOCATED_BYTES, LARGE), 1536 * KiB + 20 * MiB);
  CHECK(cp_free(fx.pool, c) == CP_OK);
  CHECK(cp_free(fx.pool, a) == CP_OK);
  CHECK(cp_empty_cache(fx.pool) == CP_OK);
  /* 10.5 MiB: a 12 MiB segment and a 1.5 MiB free rest. */
  void *d = must_alloc(&fx, 10 * MiB + 512 * KiB, 0);
  s = stats_of(&fx);
  CHECK_EQ_U(CUR(s, RESERVED_BYTES, LARGE), 12 * MiB);
  CHECK_EQ_U(CUR(s, INACTIVE_SPLIT_BYTES, LARGE), 1536 * KiB);
  CHECK(cp_free(fx.pool, d) == CP_OK);
  CHECK(cp_empty_cache(fx.pool) == CP_OK);
  /* 11 MiB: a 12 MiB segment, and the 1 MiB rest is not split off. */
  void *e = must_alloc(&fx, 11 * MiB, 0);
  s = stats_of(&fx);
  CHECK_EQ_U(CUR(s, ALLOCATED_BYTES, LARGE), 12 * MiB);
  CHECK_EQ_U(CUR(s, INACTIVE_SPLIT, LARGE), 0);
  CHECK(cp_free(fx.pool, e) == CP_OK);
  fx_close(&fx);
}

TEST(small_pool_split_rules) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 64 * MiB, NULL) == 0);
  /* The small pool keeps any remainder of at least 512 bytes. */
  void *a = must_alloc(&fx, 1 * MiB, 0); /* the largest small request */
  void *a2 = must_alloc(&fx, 1 * MiB - 1024, 0);
  CHECK((uintptr_t)a2 == (uintptr_t)a + 1 * MiB);
  void *b = must_alloc(&fx, 512, 0);
  CHECK((uintptr_t)b == (uintptr_t)a + 2 * MiB - 1024);
  void *c = must_alloc(&fx, 512, 0); /* takes the last 512 bytes */
  CHECK((uintptr_t)c == (uintptr_t)b + 512);
  cp_stats_t s = stats_of(&fx);
  CHECK_EQ_U(CUR(s, SEGMENT, SMALL), 1);
  CHECK_EQ_U(CUR(s, INACTIVE_SPLIT, SMALL), 0);
  CHECK(cp_free(fx.pool, a2) == CP_OK);
  s = stats_of(&fx);
  CHECK_EQ_U(CUR(s, INACTIVE_SPLIT, SMALL), 1);
  a2 = must_alloc(&fx, 1 * MiB - 1024, 0);
  CHECK(cp_free(fx.pool, b) == CP_OK);
  s = stats_of(&fx);
  CHECK_EQ_U(CUR(s, INACTIVE_SPLIT, SMALL), 1);
  CHECK_EQ_U(CUR(s, INACTIVE_SPLIT_BYTES, SMALL), 512);
  CHECK(cp_free(fx.pool, a) == CP_OK);
  CHECK(cp_free(fx.pool, a2) == CP_OK); /* merges with a's and b's holes */
  s = stats_of(&fx);
  CHECK_EQ_U(CUR(s, INACTIVE_SPLIT, SMALL), 1);
  CHECK_EQ_U(CUR(s, INACTIVE_SPLIT_BYTES, SMALL), 2 * MiB - 512);
  CHECK(cp_free(fx.pool, c) == CP_OK);
  s = stats_of(&fx);
  CHECK_EQ_U(CUR(s, INACTIVE_SPLIT, SMALL), 0);
  fx_close(&fx);
}

TEST(max_split_size_rules) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 1 * GiB, "max_split_size_mb:40") == 0);
  void *big = must_alloc(&fx, 50 * MiB, 0);
  cp_stats_t s = stats_of(&fx);
  CHECK(s.max_split_size == (int64_t)(40 * MiB));
  CHECK_EQ_U(s.oversize_allocations.current, 1);
  CHECK_EQ_U(s.oversize_segments.current, 1);
  CHECK(cp_free(fx.pool, big) == CP_OK);
  s = stats_of(&fx);
  CHECK_EQ_U(s.oversize_allocations.current, 0);
  /* A request below max_split_size never takes an oversize block. */
  void *mid = must_alloc(&fx, 30 * MiB, 0);
  CHECK(mid != big);
  CHECK_EQ_U(stats_of(&fx).num_device_alloc, 2);
  /* An oversize request takes it when it is less than 20 MiB too large, unsplit. */
  void *o = must_alloc(&fx, 45 * MiB, 0);
  CHECK(o == big);
  s = stats_of(&fx);
  CHECK_EQ_U(s.num_device_alloc, 2);
  CHECK_EQ_U(CUR(s, ALLOCATED_BYTES, LARGE), 30 * MiB + 50 * MiB);
  CHECK(cp_free(fx.pool, o) == CP_OK);
  /* ... but not when it is 20 MiB or more too large. */
  void *o2 = must_alloc(&fx, 41 * MiB, 0);
  CHECK(o2 == big); /* 50 - 42 = 8 MiB: fine */
  CHECK(cp_free(fx.pool, o2) == CP_OK);
  void *huge = must_alloc(&fx, 80 * MiB, 0);
  CHECK(cp_free(fx.pool, huge) == CP_OK);
  CHECK(cp_free(fx.pool, mid) == CP_OK);
  uint64_t before = stats_of(&fx).num_device_alloc;
  void *o3 = must_alloc(&fx, 42 * MiB, 0); /* takes the 50, not the 80 (best fit) */
  CHECK(o3 == big);
  void *o4 = must_alloc(&fx, 42 * MiB, 0); /* 80 >= 42 + 20: not taken, new segment */
  CHECK_EQ_U(stats_of(&fx).num_device_alloc, before + 1);
  CHECK(cp_free(fx.pool, o3) == CP_OK);
  CHECK(cp_free(fx.pool, o4) == CP_OK);
  fx_close(&fx);
}

TEST(up_to_capacity_and_oom) {
  fixture_t fx;
  REQUIRE(open_kind(&fx, 64 * MiB, NULL, NULL) == 0);
  /* Exactly the device; page-mapped, what whole 20 MiB chunks of it hold (three). */
  void *p = must_alloc(&fx, g_paged ? 60 * MiB : 64 * MiB, 0);
  CHECK(cp_free(fx.pool, p) == CP_OK);
  void *q = NULL;
  CHECK(cp_alloc(fx.pool, 64 * MiB + 1, 0, &q) == CP_ERR_OOM);
  CHECK(q == NULL);
  CHECK(strstr(cp_last_error(), "Tried to allocate") != NULL);
  CHECK(strstr(cp_last_error(), "largest free block") != NULL);
  cp_stats_t s = stats_of(&fx);
  CHECK_EQ_U(s.num_ooms, 1);
  CHECK_EQ_U(s.num_alloc_retries, 1);
  /* The cached memory went back on the retry. Stitching grows by what is missing in handles
   * of at most 20 MiB, so its last attempt maps three before the device refuses the fourth,
   * and those stay cached, free (as any page-mapped growth that fails midway leaves what it
   * mapped). */
  CHECK_EQ_U(CUR(s, RESERVED_BYTES, ALL), g_stitch ? 60 * MiB : 0);
  CHECK_EQ_U(CUR(s, ALLOCATED_BYTES, ALL), 0);
  CHECK_EQ_U(cp_sim_reserved_bytes(fx.sim), g_stitch ? 60 * MiB : 0);
  CHECK_EQ_U(cp_pool_check(fx.pool, stderr), 0);
  /* Still usable, and a fitting request works. */
  void *r = must_alloc(&fx, 32 * MiB, 0);
  CHECK(cp_free(fx.pool, r) == CP_OK);
  fx_close(&fx);
}

TEST(sizes_near_size_max) {
  fixture_t fx;
  REQUIRE(open_kind(&fx, 64 * MiB, NULL, NULL) == 0);
  size_t sizes[] = {SIZE_MAX, SIZE_MAX - 1, SIZE_MAX - 511, SIZE_MAX / 2 + 1, (size_t)1 << 62};
  for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
    void *p = (void *)1;
    CHECK(cp_alloc(fx.pool, sizes[i], 0, &p) == CP_ERR_OOM);
    CHECK(p == (void *)1); /* untouched on failure */
  }
  CHECK_EQ_U(stats_of(&fx).num_ooms, 5);
  void *q = must_alloc(&fx, 100, 0);
  CHECK(cp_free(fx.pool, q) == CP_OK);
  fx_close(&fx);
}

TEST(retry_releases_cached_segments) {
  fixture_t fx;
  REQUIRE(open_kind(&fx, 40 * MiB, NULL, NULL) == 0);
  /* Cached on another stream, so that it cannot serve the next request in either kind of
   * pool (page-mapped, the 30 MiB took two 20 MiB chunks, which would hold 32 MiB). */
  void *a = must_alloc(&fx, 30 * MiB, 1);
  CHECK(cp_free(fx.pool, a) == CP_OK);
  void *b = must_alloc(&fx, 32 * MiB, 0); /* cached + 32 > 40: retry after releasing */
  cp_stats_t s = stats_of(&fx);
  CHECK_EQ_U(s.num_alloc_retries, 1);
  CHECK_EQ_U(s.num_ooms, 0);
  /* Page-mapped: one unmap of the free range; whole chunks. Stitching maps one handle of
   * exactly the 32 MiB, after the retry gave stream 1's 30 MiB handle back. */
  CHECK_EQ_U(s.num_device_free, 1);
  CHECK_EQ_U(CUR(s, RESERVED_BYTES, ALL), g_stitch ? 32 * MiB : g_paged ? 40 * MiB : 32 * MiB);
  CHECK(cp_free(fx.pool, b) == CP_OK);
  fx_close(&fx);
}

TEST(memory_cap_and_fraction) {
  fixture_t fx;
  /* Page-mapped, the cap counts whole chunks: 2 MiB large chunks here, so that 14 MiB fit
   * under the 16 MiB cap as in a plain pool. */
  REQUIRE(open_kind(&fx, 256 * MiB, "memory_cap_mb:16", "min_large_alloc_mb:2,large_segment_mb:2") == 0);
  void *p = NULL;
  CHECK(cp_alloc(fx.pool, 20 * MiB, 0, &p) == CP_ERR_OOM);
  CHECK_EQ_U(grow_calls(&fx), 0); /* refused before the device */
  CHECK(strstr(cp_last_error(), "Memory cap: 16.00 MiB") != NULL);
  void *a = must_alloc(&fx, 14 * MiB, 0);
  CHECK(cp_free(fx.pool, a) == CP_OK);
  CHECK(cp_pool_set_memory_cap(fx.pool, 0) == CP_OK);
  void *b = must_alloc(&fx, 20 * MiB, 0);
  CHECK(cp_free(fx.pool, b) == CP_OK);
  CHECK(cp_empty_cache(fx.pool) == CP_OK);
  CHECK(cp_pool_set_memory_fraction(fx.pool, 0.25) == CP_OK); /* 64 MiB */
  void *c = must_alloc(&fx, 64 * MiB, 0);
  CHECK(cp_alloc(fx.pool, 2 * MiB, 0, &p) == CP_ERR_OOM);
  CHECK(cp_free(fx.pool, c) == CP_OK);
  CHECK(cp_pool_set_memory_fraction(fx.pool, 1.5) == CP_ERR_INVALID);
  CHECK(cp_pool_set_memory_fraction(fx.pool, -0.1) == CP_ERR_INVALID);
  cp_pool_info_t info;
  cp_pool_info(fx.pool, &info);
  CHECK_EQ_U(info.memory_cap, 64 * MiB);
  fx_close(&fx);
}

TEST(empty_cache_returns_free_segments_only) {
  fixture_t fx;
  REQUIRE(open_kind(&fx, 256 * MiB, NULL, NULL) == 0);
  void *live = must_alloc(&fx, 4096, 0);
  void *a = must_alloc(&fx, 3 * MiB, 0);
  void *b = must_alloc(&fx, 18 * MiB, 0); /* does not fit the 17 MiB rest: own segment */
  CHECK(cp_free(fx.pool, a) == CP_OK);
  CHECK(cp_free(fx.pool, b) == CP_OK);
  CHECK(cp_empty_cache(fx.pool) == CP_OK);
  cp_stats_t s = stats_of(&fx);
  CHECK_EQ_U(CUR(s, RESERVED_BYTES, ALL), 2 * MiB); /* the live block's segment stays */
  CHECK_EQ_U(cp_sim_reserved_bytes(fx.sim), 2 * MiB);
  /* Page-mapped: a and b share one range of two chunks, unmapped in one call. */
  CHECK_EQ_U(s.num_device_free, g_paged ? 1 : 2);
  CHECK(cp_free(fx.pool, live) == CP_OK);
  CHECK(cp_empty_cache(fx.pool) == CP_OK);
  CHECK_EQ_U(cp_sim_reserved_bytes(fx.sim), 0);
  fx_close(&fx);
}

TEST(garbage_collection_threshold) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 100 * MiB, "garbage_collection_threshold:0.5") == 0);
  void *a = must_alloc(&fx, 30 * MiB, 0);
  CHECK(cp_free(fx.pool, a) == CP_OK);
  void *b = must_alloc(&fx, 32 * MiB, 0); /* 30 + 32 > 50: the cached 30 goes first */
  cp_stats_t s = stats_of(&fx);
  CHECK_EQ_U(s.num_device_free, 1);
  CHECK_EQ_U(s.num_alloc_retries, 0);
  CHECK(cp_free(fx.pool, b) == CP_OK);
  fx_close(&fx);
}

TEST(release_before_grow) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 1 * GiB, "release_before_grow:True") == 0);
  void *a = must_alloc(&fx, 30 * MiB, 0);
  void *keep = must_alloc(&fx, 4096, 0);
  CHECK(cp_free(fx.pool, a) == CP_OK);
  CHECK_EQ_U(CUR(stats_of(&fx), RESERVED_BYTES, ALL), 30 * MiB + 2 * MiB); /* cached */
  void *b = must_alloc(&fx, 12 * MiB, 1); /* another stream: a's free segment goes first */
  cp_stats_t s = stats_of(&fx);
  CHECK_EQ_U(s.num_device_free, 1);
  CHECK_EQ_U(s.num_alloc_retries, 0);
  CHECK_EQ_U(CUR(s, RESERVED_BYTES, ALL), 12 * MiB + 2 * MiB); /* the live small one stays */
  void *c = must_alloc(&fx, 4 * MiB, 1);                       /* a 20 MiB segment; nothing to give back */
  CHECK_EQ_U(stats_of(&fx).num_device_free, 1);
  CHECK(cp_free(fx.pool, b) == CP_OK);
  void *d = must_alloc(&fx, 10 * MiB, 1); /* best fit: b's 12, not c's 16 MiB rest */
  CHECK(d == b);
  CHECK_EQ_U(stats_of(&fx).num_device_free, 1);
  CHECK(cp_free(fx.pool, c) == CP_OK);
  CHECK(cp_free(fx.pool, d) == CP_OK);
  CHECK(cp_free(fx.pool, keep) == CP_OK);
  fx_close(&fx);
}

TEST(release_before_grow_keeps_cache_below_high_water) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 1 * GiB, "release_before_grow:True") == 0);
  void *x = must_alloc(&fx, 40 * MiB, 0); /* high-water mark: 40 MiB */
  CHECK(cp_free(fx.pool, x) == CP_OK);
  void *y = must_alloc(&fx, 30 * MiB, 1); /* 40 + 30 > 40: x's segment goes */
  cp_stats_t s = stats_of(&fx);
  CHECK_EQ_U(s.num_device_free, 1);
  CHECK_EQ_U(CUR(s, RESERVED_BYTES, ALL), 30 * MiB);
  CHECK(cp_free(fx.pool, y) == CP_OK);
  void *z = must_alloc(&fx, 1000, 2); /* 30 + 2 <= 40: the cache stays */
  s = stats_of(&fx);
  CHECK_EQ_U(s.num_device_free, 1);
  CHECK_EQ_U(CUR(s, RESERVED_BYTES, ALL), 32 * MiB);
  void *w = must_alloc(&fx, 12 * MiB, 3); /* 32 + 12 > 40: the oldest free segment (y's) goes */
  s = stats_of(&fx);
  CHECK_EQ_U(s.num_device_free, 2);
  CHECK_EQ_U(CUR(s, RESERVED_BYTES, ALL), 2 * MiB + 12 * MiB);
  CHECK(cp_free(fx.pool, z) == CP_OK);
  CHECK(cp_free(fx.pool, w) == CP_OK);
  fx_close(&fx);
}

TEST(live_ranges_never_overlap) {
  fixture_t fx;
  REQUIRE(open_kind(&fx, 512 * MiB, NULL, NULL) == 0);
  enum { SLOTS = 200 };
  uintptr_t addr[SLOTS] = {0};
  size_t len[SLOTS] = {0};
  srand(11);
  for (int op = 0; op < 4000; op++) {
    int i = rand() % SLOTS;
    if (addr[i] != 0) {
      /* The block still holds its pattern: nobody else wrote into it. */
      unsigned char *m = (unsigned char *)addr[i];
      CHECK(m[0] == (unsigned char)i && m[len[i] - 1] == (unsigned char)(i ^ 0x5a));
      CHECK(cp_free(fx.pool, (void *)addr[i]) == CP_OK);
      addr[i] = 0;
      continue;
    }
    size_t size = (rand() % 8 == 0) ? 1 + (size_t)(rand() % (24 * (int)MiB)) : 1 + (size_t)(rand() % 200000);
    void *p = NULL;
    if (cp_alloc(fx.pool, size, (cp_stream_t)(rand() % 3), &p) != CP_OK) continue;
    uintptr_t a = (uintptr_t)p;
    CHECK(a % 512 == 0);
    for (int j = 0; j < SLOTS; j++) {
      if (addr[j] != 0) CHECK(a + size <= addr[j] || addr[j] + len[j] <= a);
    }
    addr[i] = a;
    len[i] = size;
    ((unsigned char *)p)[0] = (unsigned char)i;
    ((unsigned char *)p)[size - 1] = (unsigned char)(i ^ 0x5a);
  }
  for (int i = 0; i < SLOTS; i++) CHECK(cp_free(fx.pool, (void *)addr[i]) == CP_OK);
  cp_stats_t s = stats_of(&fx);
  CHECK_EQ_U(CUR(s, ALLOCATED_BYTES, ALL), 0);
  CHECK_EQ_U(CUR(s, ACTIVE_BYTES, ALL), 0);
  fx_close(&fx);
}

TEST(blocks_stay_on_their_stream) {
  fixture_t fx;
  REQUIRE(open_kind(&fx, 512 * MiB, NULL, NULL) == 0);
  void *a = must_alloc(&fx, 8192, 1);
  CHECK(cp_free(fx.pool, a) == CP_OK);
  void *b = must_alloc(&fx, 8192, 2); /* stream 2 never gets stream 1's block */
  CHECK(b != a);
  cp_stats_t s = stats_of(&fx);
  if (g_paged) { /* one range per (stream, kind); the segment stat counts plain segments only */
    cp_pool_info_t in;
    cp_pool_info(fx.pool, &in);
    CHECK_EQ_U(in.page_segments, 2);
    CHECK_EQ_U(CUR(s, SEGMENT, SMALL), 0);
  } else {
    CHECK_EQ_U(CUR(s, SEGMENT, SMALL), 2);
  }
  void *c = must_alloc(&fx, 8192, 1);
  CHECK(c == a);
  CHECK(cp_free(fx.pool, b) == CP_OK);
  CHECK(cp_free(fx.pool, c) == CP_OK);
  /* Many streams, each its own segments, none crossing over. */
  void *per[16];
  for (int i = 0; i < 16; i++) per[i] = must_alloc(&fx, 3 * MiB, (cp_stream_t)(100 + i));
  for (int i = 0; i < 16; i++) CHECK(cp_free(fx.pool, per[i]) == CP_OK);
  for (int i = 0; i < 16; i++) {
    void *p = must_alloc(&fx, 3 * MiB, (cp_stream_t)(100 + i));
    CHECK(p == per[i]);
    CHECK(cp_free(fx.pool, p) == CP_OK);
  }
  CHECK_EQ_U(cp_sim_calls(fx.sim, CP_SIM_EVENT_RECORD), 0); /* plain frees record nothing */
  fx_close(&fx);
}

TEST(record_stream_waits_for_event) {
  fixture_t fx;
  REQUIRE(open_kind(&fx, 256 * MiB, NULL, NULL) == 0);
  void *p = must_alloc(&fx, 1000, 1);
  CHECK(cp_record_stream(fx.pool, p, 1) == CP_OK);
  launch(&fx, 1, p, 1); /* its own stream: nothing to do */
  CHECK(cp_record_stream(fx.pool, p, 2) == CP_OK);
  launch(&fx, 2, p, 1);
  CHECK(cp_record_stream(fx.pool, p, 2) == CP_OK);
  launch(&fx, 2, p, 1); /* twice: one event */
  CHECK(cp_free(fx.pool, p) == CP_OK);
  CHECK_EQ_U(cp_sim_calls(fx.sim, CP_SIM_EVENT_RECORD), 1);
  cp_stats_t s = stats_of(&fx);
  CHECK_EQ_U(CUR(s, ALLOCATION, ALL), 0);
  CHECK_EQ_U(CUR(s, ACTIVE, ALL), 1); /* still active until stream 2 is done */
  CHECK_EQ_U(CUR(s, REQUESTED_BYTES, ALL), 1000);
  for (int i = 0; i < 10; i++) { /* busy stream 2: p is not handed out */
    void *q = must_alloc(&fx, 1000, 1);
    CHECK(q != p);
    CHECK(cp_free(fx.pool, q) == CP_OK);
  }
  cp_pool_info_t info;
  cp_pool_info(fx.pool, &info);
  CHECK_EQ_U(info.pending_blocks, 1);
  CHECK_EQ_U(info.pending_free, 1024);
  cp_sim_complete(fx.sim, 3); /* another stream finishing changes nothing */
  void *q = must_alloc(&fx, 1000, 1);
  CHECK(q != p);
  CHECK(cp_free(fx.pool, q) == CP_OK);
  cp_sim_complete(fx.sim, 2);
  void *r = must_alloc(&fx, 1000, 1);
  CHECK(r == p);
  s = stats_of(&fx);
  CHECK_EQ_U(CUR(s, ACTIVE, ALL), 1);
  CHECK(cp_free(fx.pool, r) == CP_OK);
  CHECK_EQ_U(cp_sim_calls(fx.sim, CP_SIM_EVENT_RECORD), 1); /* the plain free recorded none */
  fx_close(&fx);
}

TEST(record_stream_many_streams_and_event_pooling) {
  fixture_t fx;
  REQUIRE(open_kind(&fx, 256 * MiB, NULL, NULL) == 0);
  for (int round = 0; round < 50; round++) {
    void *p = must_alloc(&fx, 64 * KiB, 0);
    for (cp_stream_t s = 1; s <= 3; s++) {
      CHECK(cp_record_stream(fx.pool, p, s) == CP_OK);
      launch(&fx, s, p, 1);
    }
    CHECK(cp_free(fx.pool, p) == CP_OK);
    cp_sim_complete(fx.sim, 1);
    cp_sim_complete(fx.sim, 2);
    void *q = must_alloc(&fx, 64 * KiB, 0); /* stream 3 still busy */
    CHECK(q != p);
    CHECK(cp_free(fx.pool, q) == CP_OK);
    cp_sim_complete(fx.sim, 3);
    void *r = must_alloc(&fx, 64 * KiB, 0);
    CHECK(r == p);
    CHECK(cp_free(fx.pool, r) == CP_OK);
  }
  CHECK_EQ_U(cp_sim_calls(fx.sim, CP_SIM_EVENT_RECORD), 150);
  CHECK(cp_sim_calls(fx.sim, CP_SIM_EVENT_CREATE) <= 3); /* events are reused */
  fx_close(&fx);
}

TEST(empty_cache_waits_for_pending) {
  fixture_t fx;
  REQUIRE(open_kind(&fx, 256 * MiB, NULL, NULL) == 0);
  void *p = must_alloc(&fx, 5 * MiB, 0);
  CHECK(cp_record_stream(fx.pool, p, 9) == CP_OK);
  launch(&fx, 9, p, 1);
  CHECK(cp_free(fx.pool, p) == CP_OK);
  CHECK(cp_empty_cache(fx.pool) == CP_OK);
  if (g_paged) {
    /* Page-mapped: empty_cache waits for nothing (Note [Stream-ordered release]); the block
     * stays pending, and its memory reserved, until stream 9 is done. */
    CHECK_EQ_U(cp_sim_calls(fx.sim, CP_SIM_EVENT_SYNCHRONIZE), 0);
    CHECK_EQ_U(stats_of(&fx).num_sync_all_streams, 0);
    CHECK(cp_sim_reserved_bytes(fx.sim) != 0);
    CHECK_EQ_U(info_of(&fx).pending_blocks, 1);
    cp_sim_complete(fx.sim, 9);
    CHECK(cp_empty_cache(fx.pool) == CP_OK); /* the stream is idle: its drain event is done */
    CHECK_EQ_U(cp_sim_calls(fx.sim, CP_SIM_EVENT_SYNCHRONIZE), 0);
  } else {
    /* As the built-in allocator: it waits for the pending free, cudaFree for the device. */
    CHECK_EQ_U(cp_sim_calls(fx.sim, CP_SIM_EVENT_SYNCHRONIZE), 1);
    CHECK_EQ_U(stats_of(&fx).num_sync_all_streams, 1);
  }
  CHECK_EQ_U(cp_sim_reserved_bytes(fx.sim), 0);
  fx_close(&fx);
}

TEST(oom_retry_waits_for_pending) {
  fixture_t fx;
  REQUIRE(open_kind(&fx, 40 * MiB, NULL, NULL) == 0);
  void *p = must_alloc(&fx, 30 * MiB, 0);
  CHECK(cp_record_stream(fx.pool, p, 5) == CP_OK);
  launch(&fx, 5, p, 1);
  CHECK(cp_free(fx.pool, p) == CP_OK);
  void *q = must_alloc(&fx, 32 * MiB, 0); /* needs p's segment back: wait, release, grow */
  cp_stats_t s = stats_of(&fx);
  CHECK_EQ_U(s.num_alloc_retries, 1);
  CHECK_EQ_U(s.num_ooms, 0);
  CHECK(cp_free(fx.pool, q) == CP_OK);
  fx_close(&fx);
}

TEST(bad_pointers) {
  fixture_t fx;
  REQUIRE(open_kind(&fx, 64 * MiB, NULL, NULL) == 0);
  void *p = must_alloc(&fx, 4096, 0);
  cp_stats_t before = stats_of(&fx);
  int local;
  CHECK(cp_free(fx.pool, &local) == CP_ERR_INVALID);
  CHECK(strstr(cp_last_error(), "not allocated by this pool") != NULL);
  CHECK(cp_free(fx.pool, (char *)p + 512) == CP_ERR_INVALID); /* interior pointer */
  CHECK(cp_record_stream(fx.pool, &local, 3) == CP_ERR_INVALID);
  CHECK(cp_record_stream(fx.pool, NULL, 3) == CP_ERR_INVALID);
  cp_stats_t after = stats_of(&fx);
  CHECK(memcmp(&before, &after, sizeof before) == 0);
  CHECK(cp_free(fx.pool, p) == CP_OK);
  CHECK(cp_free(fx.pool, p) == CP_ERR_INVALID);             /* double free */
  CHECK(cp_record_stream(fx.pool, p, 3) == CP_ERR_INVALID); /* after free */
  fx_close(&fx);
}

TEST(stats_resets) {
  fixture_t fx;
  REQUIRE(open_kind(&fx, 64 * MiB, NULL, NULL) == 0);
  void *a = must_alloc(&fx, 100 * KiB, 0);
  void *b = must_alloc(&fx, 100 * KiB, 0);
  CHECK(cp_free(fx.pool, a) == CP_OK);
  cp_pool_reset_peak_stats(fx.pool);
  cp_stats_t s = stats_of(&fx);
  CHECK_EQ_U(PEAK(s, ALLOCATED_BYTES, ALL), 100 * KiB);
  /* Stitching: one range per stream serves every size, all counted in the large class. */
  CHECK_EQ_U(PEAK(s, ALLOCATION, SMALL), g_stitch ? 0 : 1);
  CHECK_EQ_U(PEAK(s, ALLOCATION, LARGE), g_stitch ? 1 : 0);
  cp_pool_reset_accumulated_stats(fx.pool);
  s = stats_of(&fx);
  CHECK_EQ_U(s.family[CP_STAT_ALLOCATION][CP_KIND_ALL].allocated, 0);
  CHECK_EQ_U(s.family[CP_STAT_ALLOCATION][CP_KIND_ALL].freed, 0);
  CHECK_EQ_U(s.num_device_alloc, 0);
  CHECK_EQ_U(CUR(s, ALLOCATION, ALL), 1); /* current is never reset */
  CHECK(cp_free(fx.pool, b) == CP_OK);
  s = stats_of(&fx);
  CHECK_EQ_U(s.family[CP_STAT_ALLOCATION][CP_KIND_ALL].freed, 1);
  fx_close(&fx);
}

TEST(backend_failures_leave_pool_whole) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 256 * MiB, NULL) == 0);
  void *p = NULL;
  cp_sim_fail_nth(fx.sim, CP_SIM_RESERVE, 1, CP_ERR_BACKEND);
  CHECK(cp_alloc(fx.pool, 4096, 0, &p) == CP_ERR_BACKEND);
  CHECK(strstr(cp_last_error(), "injected") != NULL);
  CHECK_EQ_U(cp_pool_check(fx.pool, stderr), 0);
  void *a = must_alloc(&fx, 4096, 0);
  /* An event that cannot be recorded: the free fails and the block stays live. */
  CHECK(cp_record_stream(fx.pool, a, 4) == CP_OK);
  launch(&fx, 4, a, 1);
  cp_sim_fail_nth(fx.sim, CP_SIM_EVENT_RECORD, 1, CP_ERR_BACKEND);
  CHECK(cp_free(fx.pool, a) == CP_ERR_BACKEND);
  cp_stats_t s = stats_of(&fx);
  CHECK_EQ_U(CUR(s, ALLOCATION, ALL), 1);
  CHECK_EQ_U(cp_pool_check(fx.pool, stderr), 0);
  CHECK(cp_free(fx.pool, a) == CP_OK);
  /* A release the device refuses keeps the segment in the pool. */
  cp_sim_complete_all(fx.sim);
  cp_sim_fail_nth(fx.sim, CP_SIM_RELEASE, 1, CP_ERR_BACKEND);
  CHECK(cp_empty_cache(fx.pool) == CP_ERR_BACKEND);
  CHECK_EQ_U(CUR(stats_of(&fx), SEGMENT, ALL), 1);
  CHECK_EQ_U(cp_pool_check(fx.pool, stderr), 0);
  CHECK(cp_empty_cache(fx.pool) == CP_OK);
  CHECK_EQ_U(CUR(stats_of(&fx), SEGMENT, ALL), 0);
  /* An OOM from the device (not the cap) ends in the same report. */
  cp_sim_fail_nth(fx.sim, CP_SIM_RESERVE, 1, CP_ERR_OOM);
  cp_sim_fail_nth(fx.sim, CP_SIM_RESERVE, 1, CP_ERR_OOM);
  void *b = must_alloc(&fx, 4096, 0); /* first try fails, the retry succeeds */
  CHECK_EQ_U(stats_of(&fx).num_alloc_retries, 1);
  CHECK(cp_free(fx.pool, b) == CP_OK);
  fx_close(&fx);
}

TEST(info_and_report) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 64 * MiB, NULL) == 0);
  void *a = must_alloc(&fx, 3 * MiB, 0);
  void *b = must_alloc(&fx, 3 * MiB, 0);
  void *c = must_alloc(&fx, 3 * MiB, 0);
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
  fx_close(&fx);
}

/* A failure in the page-mapped pass says so. */
#define RUN_PAGED(name)                                                               \
  do {                                                                                \
    int failed_ = check_tests_failed_;                                                \
    RUN(name);                                                                        \
    if (check_tests_failed_ != failed_)                                               \
      fprintf(stderr, "  (the pass with %s)\n", g_stitch ? STITCH_CONF : PAGED_CONF); \
  } while (0)

/* The checks that hold for every kind of pool, as page-mapped pools run them (RUN_PAGED). */
static void run_paged_checks(void) {
  RUN_PAGED(size_zero);
  RUN_PAGED(cached_block_reused_without_reserve);
  RUN_PAGED(up_to_capacity_and_oom);
  RUN_PAGED(sizes_near_size_max);
  RUN_PAGED(retry_releases_cached_segments);
  RUN_PAGED(memory_cap_and_fraction);
  RUN_PAGED(empty_cache_returns_free_segments_only);
  RUN_PAGED(live_ranges_never_overlap);
  RUN_PAGED(blocks_stay_on_their_stream);
  RUN_PAGED(record_stream_waits_for_event);
  RUN_PAGED(record_stream_many_streams_and_event_pooling);
  RUN_PAGED(empty_cache_waits_for_pending);
  RUN_PAGED(oom_retry_waits_for_pending);
  RUN_PAGED(bad_pointers);
  RUN_PAGED(stats_resets);
}

int main(void) {
  RUN(size_zero);
  RUN(small_request_stats);
  RUN(rounding);
  RUN(cached_block_reused_without_reserve);
  RUN(first_address_back_after_coalescing);
  RUN(large_pool_split_rules);
  RUN(small_pool_split_rules);
  RUN(max_split_size_rules);
  RUN(up_to_capacity_and_oom);
  RUN(sizes_near_size_max);
  RUN(retry_releases_cached_segments);
  RUN(memory_cap_and_fraction);
  RUN(empty_cache_returns_free_segments_only);
  RUN(garbage_collection_threshold);
  RUN(release_before_grow);
  RUN(release_before_grow_keeps_cache_below_high_water);
  RUN(live_ranges_never_overlap);
  RUN(blocks_stay_on_their_stream);
  RUN(record_stream_waits_for_event);
  RUN(record_stream_many_streams_and_event_pooling);
  RUN(empty_cache_waits_for_pending);
  RUN(oom_retry_waits_for_pending);
  RUN(bad_pointers);
  RUN(stats_resets);
  RUN(backend_failures_leave_pool_whole);
  RUN(info_and_report);
  /* The same checks over page-mapped segments, then over page-mapped segments that stitch. */
  g_paged = 1;
  run_paged_checks();
  g_stitch = 1;
  run_paged_checks();
  return check_summary("test_pool");
}
