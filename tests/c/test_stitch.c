/* test_stitch.c — stitched ranges (page_stitching:True, core/stitch.c) on the simulated device
 * with real memory: free pages from scattered holes serve one large request at a fresh
 * address, the bytes are the same memory through both addresses, kept ranges are reused
 * without device calls, streams and pending frees are respected, empty_cache and the OOM
 * retry give everything back, and every page-mapped call may fail. The ASan build runs the
 * invariant checker after every operation. */
#include <pthread.h>
#include <string.h>
#include <time.h>

#include "check.h"
#include "core/share.h"
#include "fixture.h"

#define ST "expandable_segments:True,page_stitching:True"

static uint64_t calls_of(fixture_t *fx) {
  uint64_t n = 0;
  for (int k = 0; k < CP_SIM_CALL_COUNT; k++) n += cp_sim_calls(fx->sim, (cp_sim_call_t)k);
  return n;
}

/* Four 4 MiB blocks kept live between four 4 MiB holes: 16 MiB free, no free block larger
 * than 4 MiB. Returns the base; live[] gets the kept blocks. */
static char *checkerboard(fixture_t *fx, char *live[4]) {
  char *base = NULL;
  char *holes[4];
  for (int i = 0; i < 4; i++) {
    holes[i] = must_alloc(fx, 4 * MiB, 0);
    live[i] = must_alloc(fx, 4 * MiB, 0);
    if (i == 0) base = holes[0];
  }
  for (int i = 0; i < 4; i++) CHECK(cp_free(fx->pool, holes[i]) == CP_OK);
  return base;
}

TEST(config_key) {
  cp_config_t cfg;
  cp_config_default(&cfg);
  CHECK(cp_config_parse(&cfg, "page_stitching:True") == CP_OK); /* page-mapped by itself */
  fixture_t fx;
  REQUIRE(fx_open(&fx, 64 * MiB, "page_stitching:True") == 0);
  cp_pool_info_t in;
  cp_pool_info(fx.pool, &in);
  CHECK(in.page_mapped == 1);
  fx_close(&fx);
  cp_config_default(&cfg);
  CHECK(cp_config_parse(&cfg, ST) == CP_OK);
  char text[1024];
  cp_config_format(&cfg, text, sizeof text);
  CHECK(contains(text, "expandable_segments:True,page_stitching:True"));
  cp_config_default(&cfg);
  cp_config_format(&cfg, text, sizeof text);
  CHECK(!contains(text, "page_stitching")); /* written only when True */
}

TEST(one_range_serves_both_sizes_in_single_pages) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 256 * MiB, ST) == 0);
  char *small = must_alloc(&fx, 1000, 0);
  CHECK_EQ_U(reserved_of(&fx), 2 * MiB); /* one page, not a 20 MiB chunk */
  char *large = must_alloc(&fx, 3 * MiB, 0);
  CHECK(large == small + 1024); /* the same range */
  CHECK_EQ_U(reserved_of(&fx), 4 * MiB);
  CHECK_EQ_U(info_of(&fx).page_segments, 1);
  cp_stats_t s = stats_of(&fx);
  CHECK_EQ_U(s.family[CP_STAT_ALLOCATION][CP_KIND_LARGE].current, 2);
  CHECK_EQ_U(s.family[CP_STAT_ALLOCATION][CP_KIND_SMALL].current, 0);
  CHECK_EQ_U(cp_sim_vmm_pages(fx.sim), 2); /* one handle per page, kept by the pool */
  fx_close(&fx);
}

TEST(scattered_free_pages_serve_a_large_request) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 256 * MiB, ST) == 0);
  char *live[4];
  char *base = checkerboard(&fx, live);
  for (int i = 0; i < 4; i++) fill(live[i], 4 * MiB, (unsigned char)(10 + i));
  const size_t before = reserved_of(&fx);
  CHECK_EQ_U(before, 32 * MiB);
  char *big = must_alloc(&fx, 16 * MiB, 0); /* no hole fits it; all four together do */
  CHECK_EQ_U(reserved_of(&fx), before);     /* no new memory */
  CHECK_EQ_U(info_of(&fx).stitches, 1);
  CHECK_EQ_U(info_of(&fx).stitched_ranges, 1);
  CHECK_EQ_U(info_of(&fx).stitched_space, 16 * MiB);
  CHECK(big < base || big >= base + 32 * MiB); /* a fresh address */
  /* The stitched bytes are the holes' memory, page for page. */
  fill(big, 16 * MiB, 7);
  for (int i = 0; i < 4; i++) {
    cp_page_t p1 = 0, p2 = 0;
    size_t o1 = 0, o2 = 0;
    CHECK(cp_sim_vmm_resolve(fx.sim, (uintptr_t)(base + (size_t)i * 8 * MiB), &p1, &o1, NULL) == CP_OK);
    CHECK(cp_sim_vmm_resolve(fx.sim, (uintptr_t)(big + (size_t)i * 4 * MiB), &p2, &o2, NULL) == CP_OK);
    CHECK(p1 == p2);
    CHECK(base[(size_t)i * 8 * MiB] == big[(size_t)i * 4 * MiB]);
  }
  for (int i = 0; i < 4; i++) CHECK(holds(live[i], 4 * MiB, (unsigned char)(10 + i)));
  /* While the stitched block is live, the holes are not free: a 4 MiB request grows. */
  CHECK_EQ_U(info_of(&fx).cached_free, 0);
  char *other = must_alloc(&fx, 4 * MiB, 0);
  CHECK(other >= base + 32 * MiB);
  CHECK_EQ_U(reserved_of(&fx), before + 4 * MiB);
  CHECK(holds(big, 16 * MiB, 7));
  CHECK(cp_free(fx.pool, other) == CP_OK);
  CHECK(cp_free(fx.pool, big) == CP_OK);
  /* Freed: the holes are free blocks again, and the range is kept. */
  CHECK_EQ_U(info_of(&fx).cached_free, 20 * MiB);
  CHECK_EQ_U(info_of(&fx).stitched_ranges, 1);
  char *hole = must_alloc(&fx, 4 * MiB, 0);
  CHECK(hole == base);
  CHECK(cp_free(fx.pool, hole) == CP_OK);
  for (int i = 0; i < 4; i++) CHECK(cp_free(fx.pool, live[i]) == CP_OK);
  fx_close(&fx);
}

TEST(kept_range_is_reused_without_device_calls) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 256 * MiB, ST) == 0);
  char *live[4];
  (void)checkerboard(&fx, live);
  char *big = must_alloc(&fx, 16 * MiB, 0);
  CHECK(cp_free(fx.pool, big) == CP_OK);
  const uint64_t calls = calls_of(&fx);
  for (int round = 0; round < 5; round++) {
    char *again = must_alloc(&fx, 15 * MiB + 4096, 0); /* the same page count */
    CHECK(again == big);
    CHECK(cp_free(fx.pool, again) == CP_OK);
  }
  CHECK_EQ_U(calls_of(&fx), calls);
  CHECK_EQ_U(info_of(&fx).stitches, 1);
  CHECK_EQ_U(info_of(&fx).stitch_reuses, 5);
  /* A kept range is not reused while one of its pages is taken by its segment. */
  char *hole = must_alloc(&fx, 2 * MiB, 0);
  char *big2 = must_alloc(&fx, 12 * MiB, 0); /* 14 MiB free in three holes: a new range */
  CHECK(big2 != big);
  CHECK_EQ_U(info_of(&fx).stitches, 2);
  CHECK(cp_free(fx.pool, big2) == CP_OK);
  CHECK(cp_free(fx.pool, hole) == CP_OK);
  /* A smaller request takes the front of the smallest kept range: only the pages behind it
   * are lent, the others stay free in their segment. */
  const size_t free_before = info_of(&fx).cached_free;
  const uint64_t calls_before = calls_of(&fx);
  char *part = must_alloc(&fx, 6 * MiB, 0);
  CHECK_EQ_U(calls_of(&fx), calls_before);
  CHECK(part == big2);
  CHECK_EQ_U(info_of(&fx).stitches, 2);
  CHECK_EQ_U(info_of(&fx).cached_free, free_before - 6 * MiB);
  fill(part, 6 * MiB, 8);
  CHECK(holds(part, 6 * MiB, 8));
  CHECK(cp_free(fx.pool, part) == CP_OK);
  CHECK_EQ_U(info_of(&fx).cached_free, free_before);
  for (int i = 0; i < 4; i++) CHECK(cp_free(fx.pool, live[i]) == CP_OK);
  fx_close(&fx);
}

TEST(top_up_maps_only_the_missing_pages) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 256 * MiB, ST) == 0);
  char *live[4];
  (void)checkerboard(&fx, live);
  const size_t before = reserved_of(&fx);
  /* 16 MiB free in holes, 20 MiB asked: growing one block would map 20 MiB; stitching the
   * holes with 4 MiB of new pages maps only those. */
  char *big = must_alloc(&fx, 20 * MiB, 0);
  CHECK_EQ_U(reserved_of(&fx), before + 4 * MiB);
  CHECK_EQ_U(info_of(&fx).stitches, 1);
  fill(big, 20 * MiB, 3);
  CHECK(holds(big, 20 * MiB, 3));
  CHECK(cp_free(fx.pool, big) == CP_OK);
  for (int i = 0; i < 4; i++) CHECK(cp_free(fx.pool, live[i]) == CP_OK);
  fx_close(&fx);
}

TEST(streams_keep_their_pages) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 256 * MiB, ST) == 0);
  char *live[4];
  (void)checkerboard(&fx, live); /* stream 0's holes */
  const size_t before = reserved_of(&fx);
  char *other = must_alloc(&fx, 16 * MiB, 5); /* stream 5 has no free pages: it grows */
  CHECK_EQ_U(reserved_of(&fx), before + 16 * MiB);
  CHECK_EQ_U(info_of(&fx).stitches, 0);
  CHECK(cp_free(fx.pool, other) == CP_OK);
  /* A stitched block used on another stream keeps its pages until that stream is done. */
  char *big = must_alloc(&fx, 16 * MiB, 0);
  CHECK_EQ_U(info_of(&fx).stitches, 1);
  CHECK(cp_record_stream(fx.pool, big, 7) == CP_OK);
  launch(&fx, 7, big, 1);
  CHECK(cp_free(fx.pool, big) == CP_OK);
  CHECK_EQ_U(info_of(&fx).pending_blocks, 1);
  char *hole = must_alloc(&fx, 4 * MiB, 0); /* not a lent hole: the pages wait */
  CHECK(hole >= live[3] + 4 * MiB);
  CHECK(cp_free(fx.pool, hole) == CP_OK);
  cp_sim_complete(fx.sim, 7);
  char *again = must_alloc(&fx, 16 * MiB, 0); /* events done: the kept range serves it */
  CHECK(again == big);
  CHECK_EQ_U(info_of(&fx).stitch_reuses, 1);
  CHECK(cp_free(fx.pool, again) == CP_OK);
  for (int i = 0; i < 4; i++) CHECK(cp_free(fx.pool, live[i]) == CP_OK);
  fx_close(&fx);
}

TEST(empty_cache_drops_idle_ranges_and_unmaps_free_pages) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 256 * MiB, ST) == 0);
  char *live[4];
  (void)checkerboard(&fx, live);
  char *busy = must_alloc(&fx, 16 * MiB, 0);
  fill(busy, 16 * MiB, 4);
  for (int i = 0; i < 4; i++) fill(live[i], 4 * MiB, (unsigned char)(20 + i));
  /* A range in use stays, and its pages stay mapped. */
  CHECK(empty_cache_idle(&fx) == CP_OK);
  CHECK_EQ_U(info_of(&fx).stitched_ranges, 1);
  CHECK(holds(busy, 16 * MiB, 4));
  CHECK(cp_free(fx.pool, busy) == CP_OK);
  CHECK(empty_cache_idle(&fx) == CP_OK);
  CHECK_EQ_U(info_of(&fx).stitched_ranges, 0);
  CHECK_EQ_U(info_of(&fx).stitched_space, 0);
  CHECK_EQ_U(reserved_of(&fx), 16 * MiB); /* the four live blocks' pages only */
  CHECK_EQ_U(cp_sim_vmm_mapped_bytes(fx.sim), 16 * MiB);
  CHECK_EQ_U(cp_sim_vmm_page_bytes(fx.sim), 16 * MiB); /* every free page released */
  for (int i = 0; i < 4; i++) CHECK(holds(live[i], 4 * MiB, (unsigned char)(20 + i)));
  for (int i = 0; i < 4; i++) CHECK(cp_free(fx.pool, live[i]) == CP_OK);
  CHECK(empty_cache_idle(&fx) == CP_OK);
  CHECK_EQ_U(reserved_of(&fx), 0);
  CHECK_EQ_U(cp_sim_vmm_pages(fx.sim), 0);
  fx_close(&fx);
}

TEST(idle_ranges_wait_for_the_work_queued_on_them) {
  /* A stitched block freed while a kernel on its stream may still use it: empty_cache must
   * not unmap the range (or its pages) before that work is done, and waits for nothing. */
  fixture_t fx;
  REQUIRE(fx_open(&fx, 256 * MiB, ST) == 0);
  char *live[4];
  (void)checkerboard(&fx, live);
  char *big = must_alloc(&fx, 16 * MiB, 0);
  CHECK_EQ_U(info_of(&fx).stitched_ranges, 1);
  launch(&fx, 0, big, 16 * MiB);
  CHECK(cp_free(fx.pool, big) == CP_OK);
  const size_t before = reserved_of(&fx);
  CHECK(cp_empty_cache(fx.pool) == CP_OK);
  CHECK_EQ_U(cp_sim_device_faults(fx.sim), 0);
  CHECK_EQ_U(cp_sim_calls(fx.sim, CP_SIM_EVENT_SYNCHRONIZE), 0);
  CHECK_EQ_U(info_of(&fx).stitched_ranges, 1); /* retired, still mapped */
  CHECK_EQ_U(reserved_of(&fx), before);
  /* Retired memory is not handed out again: a new request maps afresh or revives it. */
  cp_sim_complete(fx.sim, 0);
  CHECK(cp_empty_cache(fx.pool) == CP_OK);
  CHECK_EQ_U(info_of(&fx).stitched_ranges, 0);
  CHECK_EQ_U(reserved_of(&fx), 16 * MiB); /* the four live blocks' pages only */
  for (int i = 0; i < 4; i++) CHECK(cp_free(fx.pool, live[i]) == CP_OK);
  CHECK(empty_cache_idle(&fx) == CP_OK);
  CHECK_EQ_U(reserved_of(&fx), 0);
  fx_close(&fx);
}

TEST(trimmed_ranges_wait_for_the_work_queued_on_them) {
  /* Past 64 kept ranges the least recently used idle one goes: not before the work queued on
   * its stream is done (its block's last use may still be running on a GPU). */
  const size_t page = 64 * KiB;
  fixture_t fx;
  cp_config_t cfg;
  cp_config_default(&cfg);
  REQUIRE(cp_config_parse(&cfg, ST) == CP_OK);
  REQUIRE(cp_sim_create(64 * MiB, 0, &fx.sim) == CP_OK);
  REQUIRE(cp_sim_set_vmm_granularity(fx.sim, page) == CP_OK);
  cp_sim_backend(fx.sim, &fx.backend);
  REQUIRE(cp_pool_create(&cfg, &fx.backend, &fx.pool) == CP_OK);
  enum { HOLES = 80, RANGES = 70 };
  char *hole[HOLES], *live[HOLES];
  for (int i = 0; i < HOLES; i++) {
    hole[i] = must_alloc(&fx, page, 0);
    live[i] = must_alloc(&fx, page, 0);
  }
  for (int i = 0; i < HOLES; i++) CHECK(cp_free(fx.pool, hole[i]) == CP_OK);
  /* Ever larger requests of scattered single pages: each is a new range, kept when freed. */
  for (size_t k = 2; k < 2 + RANGES; k++) {
    char *p = must_alloc(&fx, k * page, 0);
    launch(&fx, 0, p, k * page); /* still queued when the range is trimmed */
    CHECK(cp_free(fx.pool, p) == CP_OK);
  }
  cp_pool_info_t in = info_of(&fx);
  CHECK_EQ_U(in.stitches, RANGES);
  CHECK(in.stitched_ranges > 64); /* the trimmed ones wait, retired */
  CHECK_EQ_U(cp_sim_device_faults(fx.sim), 0);
  /* Once the stream has run its work they go, with the rest. */
  for (int i = 0; i < HOLES; i++) CHECK(cp_free(fx.pool, live[i]) == CP_OK);
  CHECK(empty_cache_idle(&fx) == CP_OK);
  in = info_of(&fx);
  CHECK_EQ_U(in.stitched_ranges, 0);
  CHECK_EQ_U(reserved_of(&fx), 0);
  fx_close(&fx);
}

TEST(oom_retry_waits_for_its_stream_not_the_device) {
  /* The retry waits for the drain events of the streams whose memory it gives back; work of
   * a stream with nothing to give back stays queued. */
  fixture_t fx;
  REQUIRE(fx_open(&fx, 64 * MiB, ST) == 0);
  char *a = must_alloc(&fx, 32 * MiB, 1);
  char *b = must_alloc(&fx, 16 * MiB, 3); /* stream 3: all in use, nothing to give back */
  launch(&fx, 1, a, 32 * MiB);
  launch(&fx, 3, b, 16 * MiB);
  CHECK(cp_free(fx.pool, a) == CP_OK);    /* 32 MiB of stream 1, free but maybe still in use */
  char *c = must_alloc(&fx, 40 * MiB, 2); /* needs stream 1's pages back */
  CHECK_EQ_U(cp_sim_device_faults(fx.sim), 0);
  CHECK(cp_sim_stream_idle(fx.sim, 1));                /* waited for */
  CHECK(!cp_sim_stream_idle(fx.sim, 3));               /* never waited for */
  CHECK_EQ_U(cp_sim_calls(fx.sim, CP_SIM_RELEASE), 0); /* no cudaFree: it would wait for the device */
  CHECK_EQ_U(stats_of(&fx).num_alloc_retries, 1);
  CHECK(cp_free(fx.pool, b) == CP_OK);
  CHECK(cp_free(fx.pool, c) == CP_OK);
  fx_close(&fx);
}

TEST(oom_retry_drops_idle_ranges) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 32 * MiB, ST) == 0);
  char *live[4];
  (void)checkerboard(&fx, live); /* the whole device */
  char *big = must_alloc(&fx, 16 * MiB, 0);
  CHECK(cp_free(fx.pool, big) == CP_OK);
  void *p = NULL;
  CHECK(cp_alloc(fx.pool, 18 * MiB, 0, &p) == CP_ERR_OOM); /* 16 MiB free at most */
  CHECK_EQ_U(info_of(&fx).stitched_ranges, 0);             /* the retry dropped the idle one */
  CHECK_EQ_U(stats_of(&fx).num_ooms, 1);
  CHECK(cp_free(fx.pool, live[1]) == CP_OK);
  p = must_alloc(&fx, 20 * MiB, 0); /* 20 MiB free pages now */
  fill(p, 20 * MiB, 6);
  CHECK(holds(p, 20 * MiB, 6));
  CHECK(cp_free(fx.pool, p) == CP_OK);
  CHECK(cp_free(fx.pool, live[0]) == CP_OK);
  CHECK(cp_free(fx.pool, live[2]) == CP_OK);
  CHECK(cp_free(fx.pool, live[3]) == CP_OK);
  fx_close(&fx);
}

/* Fail the nth call of `kind` while stitching: the request is served by growing, or fails;
 * either way the pool is whole, and the next stitch works. */
static void fail_while_stitching(cp_sim_call_t kind, uint64_t nth) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 256 * MiB, ST) == 0);
  char *live[4];
  (void)checkerboard(&fx, live);
  cp_sim_fail_nth(fx.sim, kind, nth, CP_ERR_BACKEND);
  void *p = NULL;
  int rc = cp_alloc(fx.pool, 16 * MiB, 0, &p);
  cp_sim_fail_nth(fx.sim, kind, 0, CP_OK); /* disarmed, if the stitch did not reach it */
  CHECK(rc == CP_OK || rc == CP_ERR_BACKEND);
  CHECK_EQ_U(cp_pool_check(fx.pool, stderr), 0);
  if (rc == CP_OK) {
    fill(p, 16 * MiB, 1);
    CHECK(holds(p, 16 * MiB, 1));
    CHECK(cp_free(fx.pool, p) == CP_OK);
  }
  p = must_alloc(&fx, 16 * MiB, 0);
  fill(p, 16 * MiB, 2);
  CHECK(holds(p, 16 * MiB, 2));
  CHECK(cp_free(fx.pool, p) == CP_OK);
  for (int i = 0; i < 4; i++) CHECK(cp_free(fx.pool, live[i]) == CP_OK);
  CHECK(empty_cache_idle(&fx) == CP_OK);
  CHECK_EQ_U(reserved_of(&fx), 0);
  CHECK_EQ_U(cp_sim_vmm_pages(fx.sim), 0);
  fx_close(&fx);
}

TEST(failures_of_each_stitching_call) {
  const cp_sim_call_t kinds[] = {CP_SIM_VA_RESERVE, CP_SIM_PAGE_MAP, CP_SIM_PAGE_SET_ACCESS, CP_SIM_PAGE_UNMAP,
                                 CP_SIM_VA_FREE};
  for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
    for (uint64_t nth = 1; nth <= 3; nth++) fail_while_stitching(kinds[k], nth);
  }
}

/* Dropping an idle range whose unmap succeeds and whose address range the device refuses to
 * give back: the range is kept, unmapped, and must never serve again (its addresses hold no
 * memory); the next empty_cache only gives its address range back. */
TEST(range_unmapped_but_not_given_back_never_serves) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 256 * MiB, ST) == 0);
  char *live[4];
  (void)checkerboard(&fx, live);
  char *big = must_alloc(&fx, 16 * MiB, 0);
  CHECK(cp_free(fx.pool, big) == CP_OK);
  const size_t ranges = cp_sim_vmm_ranges(fx.sim);
  cp_sim_fail_nth(fx.sim, CP_SIM_VA_FREE, 1, CP_ERR_BACKEND);
  CHECK(empty_cache_idle(&fx) == CP_ERR_BACKEND);
  CHECK_EQ_U(cp_pool_check(fx.pool, stderr), 0);
  CHECK_EQ_U(cp_sim_vmm_ranges(fx.sim), ranges);                 /* its address range is still held */
  CHECK_EQ_U(cp_sim_vmm_mapped_bytes(fx.sim), reserved_of(&fx)); /* but nothing is mapped there */
  /* The same request again: not served by the unmapped range. */
  char *again = must_alloc(&fx, 16 * MiB, 0);
  CHECK(again != big);
  fill(again, 16 * MiB, 3);
  CHECK(holds(again, 16 * MiB, 3));
  CHECK(cp_free(fx.pool, again) == CP_OK);
  CHECK(empty_cache_idle(&fx) == CP_OK); /* gives back both ranges' addresses */
  CHECK_EQ_U(info_of(&fx).stitched_ranges, 0);
  CHECK_EQ_U(cp_sim_vmm_ranges(fx.sim), ranges - 1);
  for (int i = 0; i < 4; i++) CHECK(cp_free(fx.pool, live[i]) == CP_OK);
  fx_close(&fx);
}

/* A stitch fails midway (a page_map or page_set_access refused) and undoing it fails too (the
 * page_unmap or the va_free refused): the range's address range, and what is still mapped
 * there, are not lost: the next empty_cache gives them back, and the device holds nothing of
 * it at the end. */
static void fail_stitch_and_its_undo(cp_sim_call_t first, cp_sim_call_t undo) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 256 * MiB, ST) == 0);
  char *live[4];
  (void)checkerboard(&fx, live);
  cp_sim_fail_nth(fx.sim, first, first == CP_SIM_PAGE_MAP ? 3 : 1, CP_ERR_BACKEND);
  cp_sim_fail_nth(fx.sim, undo, 1, CP_ERR_BACKEND);
  void *p = NULL;
  int rc = cp_alloc(fx.pool, 16 * MiB, 0, &p);
  cp_sim_fail_nth(fx.sim, first, 0, CP_OK);
  cp_sim_fail_nth(fx.sim, undo, 0, CP_OK);
  CHECK_EQ_U(cp_pool_check(fx.pool, stderr), 0);
  if (rc == CP_OK) CHECK(cp_free(fx.pool, p) == CP_OK); /* served by growing */
  for (int i = 0; i < 4; i++) CHECK(cp_free(fx.pool, live[i]) == CP_OK);
  CHECK(empty_cache_idle(&fx) == CP_OK);
  CHECK_EQ_U(cp_pool_check(fx.pool, stderr), 0);
  CHECK_EQ_U(info_of(&fx).stitched_ranges, 0);
  CHECK_EQ_U(cp_sim_vmm_ranges(fx.sim), 0);
  CHECK_EQ_U(cp_sim_vmm_mappings(fx.sim), 0);
  CHECK_EQ_U(cp_sim_vmm_pages(fx.sim), 0);
  fx_close(&fx);
}

TEST(failed_stitch_whose_undo_fails_is_given_back_later) {
  fail_stitch_and_its_undo(CP_SIM_PAGE_MAP, CP_SIM_PAGE_UNMAP);
  fail_stitch_and_its_undo(CP_SIM_PAGE_MAP, CP_SIM_VA_FREE);
  fail_stitch_and_its_undo(CP_SIM_PAGE_SET_ACCESS, CP_SIM_PAGE_UNMAP);
  fail_stitch_and_its_undo(CP_SIM_PAGE_SET_ACCESS, CP_SIM_VA_FREE);
}

/* Dropping an idle range fails with its pages still mapped there (page_unmap refused): the
 * release that follows must not unmap and release those pages in their segments, or the
 * device would hold memory the pool no longer counts (and the range would map pages its
 * segments no longer have). The next empty_cache gives everything back. */
TEST(pages_of_a_range_not_dropped_stay_in_their_segments) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 256 * MiB, ST) == 0);
  char *live[4];
  (void)checkerboard(&fx, live);
  char *big = must_alloc(&fx, 16 * MiB, 0);
  CHECK(cp_free(fx.pool, big) == CP_OK);
  cp_sim_fail_nth(fx.sim, CP_SIM_PAGE_UNMAP, 1, CP_ERR_BACKEND); /* the range's unmap */
  CHECK(empty_cache_idle(&fx) == CP_ERR_BACKEND);
  CHECK_EQ_U(cp_pool_check(fx.pool, stderr), 0);
  CHECK_EQ_U(info_of(&fx).stitched_ranges, 1);
  CHECK_EQ_U(cp_sim_reserved_bytes(fx.sim), reserved_of(&fx)); /* every page the device holds is counted */
  CHECK_EQ_U(cp_sim_vmm_mapped_bytes(fx.sim), reserved_of(&fx) + 16 * MiB);
  char *again = must_alloc(&fx, 16 * MiB, 0); /* the kept range, whole again */
  fill(again, 16 * MiB, 4);
  CHECK(holds(again, 16 * MiB, 4));
  CHECK(cp_free(fx.pool, again) == CP_OK);
  for (int i = 0; i < 4; i++) CHECK(cp_free(fx.pool, live[i]) == CP_OK);
  CHECK(empty_cache_idle(&fx) == CP_OK);
  CHECK_EQ_U(cp_sim_vmm_ranges(fx.sim), 0);
  CHECK_EQ_U(cp_sim_vmm_pages(fx.sim), 0);
  fx_close(&fx);
}

typedef struct stitcher_s {
  cp_pool_t *pool;
  void *p;
  int rc;
} stitcher_t;

static void *stitch_thread(void *arg) {
  stitcher_t *t = arg;
  t->rc = cp_alloc(t->pool, 16 * MiB, 0, &t->p);
  return NULL;
}

/* While a range is being stitched (its pages mapped without the pool lock), its runs are
 * already LENT out of their segments: the pool is whole, seen from another thread. */
TEST(pool_is_whole_while_a_range_is_stitched) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 256 * MiB, ST) == 0);
  char *live[4];
  (void)checkerboard(&fx, live);
  cp_sim_delay_nth(fx.sim, CP_SIM_PAGE_MAP, 2, 300); /* the second page of the range */
  stitcher_t t = {fx.pool, NULL, -1};
  pthread_t th;
  REQUIRE(pthread_create(&th, NULL, stitch_thread, &t) == 0);
  for (int waited = 0; cp_sim_delays_entered(fx.sim) == 0 && waited < 5000; waited++) {
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
  CHECK_EQ_U(cp_sim_delays_entered(fx.sim), 1);
  CHECK_EQ_U(cp_pool_check(fx.pool, stderr), 0); /* the second page is being mapped */
  pthread_join(th, NULL);
  CHECK(t.rc == CP_OK);
  CHECK_EQ_U(info_of(&fx).stitches, 1);
  CHECK_EQ_U(cp_pool_check(fx.pool, stderr), 0);
  CHECK(cp_free(fx.pool, t.p) == CP_OK);
  for (int i = 0; i < 4; i++) CHECK(cp_free(fx.pool, live[i]) == CP_OK);
  fx_close(&fx);
}

/* A stitch that fails (its second page_map refused) undoes what it mapped without the pool
 * lock, its runs still LENT until it gives them back: the pool is whole then too, seen from
 * another thread (a pause waits for it as for a stitch under way). */
TEST(pool_is_whole_while_a_failed_stitch_is_undone) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 256 * MiB, ST) == 0);
  char *live[4];
  (void)checkerboard(&fx, live);
  cp_sim_fail_nth(fx.sim, CP_SIM_PAGE_MAP, 2, CP_ERR_BACKEND);
  cp_sim_delay_nth(fx.sim, CP_SIM_PAGE_UNMAP, 1, 300); /* the undo's unmap */
  stitcher_t t = {fx.pool, NULL, -1};
  pthread_t th;
  REQUIRE(pthread_create(&th, NULL, stitch_thread, &t) == 0);
  for (int waited = 0; cp_sim_delays_entered(fx.sim) == 0 && waited < 5000; waited++) {
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
  CHECK_EQ_U(cp_sim_delays_entered(fx.sim), 1);
  CHECK_EQ_U(cp_pool_check(fx.pool, stderr), 0); /* the undo is unmapping */
  pthread_join(th, NULL);
  CHECK(t.rc == CP_OK); /* served by growing instead */
  CHECK_EQ_U(info_of(&fx).stitches, 0);
  CHECK_EQ_U(cp_pool_check(fx.pool, stderr), 0);
  CHECK(cp_free(fx.pool, t.p) == CP_OK);
  for (int i = 0; i < 4; i++) CHECK(cp_free(fx.pool, live[i]) == CP_OK);
  CHECK(empty_cache_idle(&fx) == CP_OK);
  CHECK_EQ_U(cp_sim_vmm_pages(fx.sim), 0);
  fx_close(&fx);
}

TEST(destroy_with_ranges_in_use) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 256 * MiB, ST) == 0);
  char *live[4];
  (void)checkerboard(&fx, live);
  (void)must_alloc(&fx, 16 * MiB, 0);
  fx_close(&fx); /* everything goes back to the device */
}

TEST(fallback_without_vmm) {
  fixture_t fx;
  REQUIRE(fx_open_sim(&fx, 256 * MiB, CP_SIM_NO_VMM, ST) == 0);
  CHECK(info_of(&fx).page_mapped == 0);
  void *small = must_alloc(&fx, 1000, 0);
  cp_stats_t s = stats_of(&fx);
  CHECK_EQ_U(s.family[CP_STAT_ALLOCATION][CP_KIND_SMALL].current, 1); /* plain pools as ever */
  CHECK(cp_free(fx.pool, small) == CP_OK);
  fx_close(&fx);
}

/* Three 20 MiB handles: the first holds a live 8 MiB block and 12 MiB free behind it, the
 * second is live, the third has 12 MiB free before a live 8 MiB block. *out gets the live
 * blocks (first, middle, last); returns the segment's base. */
static char *handles_in_part_use(fixture_t *fx, char *out[3]) {
  char *a = must_alloc(fx, 20 * MiB, 0);
  out[1] = must_alloc(fx, 20 * MiB, 0);
  char *c = must_alloc(fx, 20 * MiB, 0);
  CHECK(out[1] == a + 20 * MiB && c == a + 40 * MiB);
  CHECK_EQ_U(cp_sim_vmm_pages(fx->sim), 3); /* one handle per growth */
  CHECK(cp_free(fx->pool, a) == CP_OK);
  CHECK(cp_free(fx->pool, c) == CP_OK);
  out[0] = must_alloc(fx, 8 * MiB, 0);
  char *q = must_alloc(fx, 12 * MiB, 0);
  char *r = must_alloc(fx, 12 * MiB, 0);
  out[2] = must_alloc(fx, 8 * MiB, 0);
  CHECK(out[0] == a && q == a + 8 * MiB && r == c && out[2] == c + 12 * MiB);
  CHECK(cp_free(fx->pool, q) == CP_OK);
  CHECK(cp_free(fx->pool, r) == CP_OK);
  return a;
}

TEST(handles_in_part_use_open_and_close_a_range) {
  /* 24 MiB free in two 12 MiB pieces of handles whose other parts are in use: the range maps
   * both handles whole and its block starts 8 MiB into it, so no new memory is mapped (before,
   * only wholly free handles stitched and the request grew the pool by 24 MiB). */
  fixture_t fx;
  REQUIRE(fx_open(&fx, 256 * MiB, ST) == 0);
  char *live[3];
  char *base = handles_in_part_use(&fx, live);
  for (int i = 0; i < 3; i++) fill(live[i], i == 1 ? 20 * MiB : 8 * MiB, (unsigned char)(30 + i));
  const size_t before = reserved_of(&fx);
  CHECK_EQ_U(before, 60 * MiB);
  char *big = must_alloc(&fx, 24 * MiB, 0);
  CHECK_EQ_U(reserved_of(&fx), before);
  CHECK_EQ_U(info_of(&fx).stitches, 1);
  CHECK_EQ_U(info_of(&fx).stitched_space, 40 * MiB); /* both handles, whole */
  CHECK(big < base || big >= base + 60 * MiB);
  /* Its first 12 MiB are the first handle's free end, the next 12 the last handle's start. */
  cp_page_t p1 = 0, p2 = 0;
  size_t o1 = 0, o2 = 0;
  CHECK(cp_sim_vmm_resolve(fx.sim, (uintptr_t)big, &p1, &o1, NULL) == CP_OK);
  CHECK(cp_sim_vmm_resolve(fx.sim, (uintptr_t)(base + 8 * MiB), &p2, &o2, NULL) == CP_OK);
  CHECK(p1 == p2 && o1 == o2 && o1 == 8 * MiB);
  CHECK(cp_sim_vmm_resolve(fx.sim, (uintptr_t)(big + 12 * MiB), &p1, &o1, NULL) == CP_OK);
  CHECK(cp_sim_vmm_resolve(fx.sim, (uintptr_t)(base + 40 * MiB), &p2, &o2, NULL) == CP_OK);
  CHECK(p1 == p2 && o1 == o2 && o1 == 0);
  fill(big, 24 * MiB, 9);
  CHECK(base[8 * MiB] == 9 && base[40 * MiB] == 9);
  for (int i = 0; i < 3; i++) CHECK(holds(live[i], i == 1 ? 20 * MiB : 8 * MiB, (unsigned char)(30 + i)));
  CHECK_EQ_U(info_of(&fx).cached_free, 0);
  /* Shared, the block is its handles with the block 8 MiB into them. */
  cp_share_t sh;
  CHECK(cp_pool_share(fx.pool, big, &sh) == CP_OK);
  CHECK(sh.paged && sh.offset == 8 * MiB && sh.span_count == 2);
  cp_share_release(&sh);
  /* The live blocks around it go: their pages are mapped in the range too, so empty_cache
   * keeps them (unmapping one would leave memory on the device that nothing counts). */
  CHECK(cp_free(fx.pool, live[0]) == CP_OK);
  CHECK(cp_free(fx.pool, live[2]) == CP_OK);
  CHECK(empty_cache_idle(&fx) == CP_OK);
  CHECK_EQ_U(cp_sim_vmm_page_bytes(fx.sim), reserved_of(&fx));
  CHECK_EQ_U(reserved_of(&fx), before);
  CHECK(holds(big, 24 * MiB, 9));
  live[0] = must_alloc(&fx, 8 * MiB, 0);
  live[2] = must_alloc(&fx, 8 * MiB, 0);
  CHECK(live[0] == base && live[2] == base + 52 * MiB);
  CHECK_EQ_U(cp_sim_device_faults(fx.sim), 0);
  /* Freed, the range is kept and serves the same request again without a device call. */
  CHECK(cp_free(fx.pool, big) == CP_OK);
  CHECK_EQ_U(info_of(&fx).cached_free, 24 * MiB);
  const uint64_t calls = calls_of(&fx);
  char *again = must_alloc(&fx, 24 * MiB, 0);
  CHECK(again == big);
  CHECK_EQ_U(calls_of(&fx), calls);
  CHECK_EQ_U(info_of(&fx).stitch_reuses, 1);
  CHECK(cp_free(fx.pool, again) == CP_OK);
  for (int i = 0; i < 3; i++) CHECK(cp_free(fx.pool, live[i]) == CP_OK);
  CHECK(empty_cache_idle(&fx) == CP_OK);
  CHECK_EQ_U(reserved_of(&fx), 0);
  CHECK_EQ_U(cp_sim_vmm_pages(fx.sim), 0);
  fx_close(&fx);
}

TEST(partial_handles_off_stitches_whole_handles_only) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 256 * MiB, ST ",stitch_partial_handles:False") == 0);
  char *live[3];
  (void)handles_in_part_use(&fx, live);
  const size_t before = reserved_of(&fx);
  char *big = must_alloc(&fx, 24 * MiB, 0); /* no whole free handle: it grows */
  CHECK_EQ_U(reserved_of(&fx), before + 24 * MiB);
  CHECK_EQ_U(info_of(&fx).stitches, 0);
  cp_config_t cfg;
  cp_pool_config(fx.pool, &cfg);
  char text[1024];
  cp_config_format(&cfg, text, sizeof text);
  CHECK(contains(text, "stitch_partial_handles:False"));
  cp_config_default(&cfg);
  cp_config_format(&cfg, text, sizeof text);
  CHECK(!contains(text, "stitch_partial_handles")); /* written only when False */
  CHECK(cp_free(fx.pool, big) == CP_OK);
  for (int i = 0; i < 3; i++) CHECK(cp_free(fx.pool, live[i]) == CP_OK);
  fx_close(&fx);
}

TEST(a_handle_in_part_use_completes_whole_ones) {
  /* A wholly free 20 MiB handle and a handle whose first 12 MiB are free: a 26 MiB request
   * takes the whole one first and only the 6 MiB it lacks from the other, whose rest stays
   * free in its segment. */
  fixture_t fx;
  REQUIRE(fx_open(&fx, 256 * MiB, ST) == 0);
  char *live[3];
  char *base = handles_in_part_use(&fx, live);
  CHECK(cp_free(fx.pool, live[0]) == CP_OK); /* the first handle is wholly free now */
  const size_t before = reserved_of(&fx);
  char *big = must_alloc(&fx, 26 * MiB, 0);
  CHECK_EQ_U(reserved_of(&fx), before);
  CHECK_EQ_U(info_of(&fx).stitches, 1);
  CHECK_EQ_U(info_of(&fx).stitched_space, 40 * MiB);
  cp_page_t p1 = 0, p2 = 0;
  size_t o1 = 0, o2 = 0;
  CHECK(cp_sim_vmm_resolve(fx.sim, (uintptr_t)(big + 20 * MiB), &p1, &o1, NULL) == CP_OK);
  CHECK(cp_sim_vmm_resolve(fx.sim, (uintptr_t)(base + 40 * MiB), &p2, &o2, NULL) == CP_OK);
  CHECK(p1 == p2 && o1 == o2);
  CHECK_EQ_U(info_of(&fx).cached_free, 6 * MiB);
  char *rest = must_alloc(&fx, 6 * MiB, 0); /* what the range left of the last handle */
  CHECK(rest == base + 46 * MiB);
  CHECK_EQ_U(reserved_of(&fx), before);
  fill(big, 26 * MiB, 6);
  fill(rest, 6 * MiB, 7);
  CHECK(holds(big, 26 * MiB, 6));
  CHECK(cp_free(fx.pool, big) == CP_OK);
  CHECK(holds(rest, 6 * MiB, 7));
  CHECK(cp_free(fx.pool, rest) == CP_OK);
  for (int i = 1; i < 3; i++) CHECK(cp_free(fx.pool, live[i]) == CP_OK);
  CHECK(empty_cache_idle(&fx) == CP_OK);
  CHECK_EQ_U(reserved_of(&fx), 0);
  CHECK_EQ_U(cp_sim_device_faults(fx.sim), 0);
  fx_close(&fx);
}

TEST(empty_cache_keeps_free_pages_a_range_in_use_still_maps) {
  /* A kept range of four holes serves a request of two: the other two holes are free in their
   * range but still mapped behind the stitched block's end. Unmapping them there would leave
   * their memory on the device, uncounted; empty_cache leaves them until the block is freed. */
  fixture_t fx;
  REQUIRE(fx_open(&fx, 256 * MiB, ST) == 0);
  char *live[4];
  (void)checkerboard(&fx, live);
  char *big = must_alloc(&fx, 16 * MiB, 0);
  CHECK(cp_free(fx.pool, big) == CP_OK);
  char *part = must_alloc(&fx, 8 * MiB, 0);
  CHECK(part == big);
  CHECK(empty_cache_idle(&fx) == CP_OK);
  CHECK_EQ_U(cp_sim_vmm_page_bytes(fx.sim), reserved_of(&fx));
  CHECK_EQ_U(info_of(&fx).stitched_ranges, 1);
  fill(part, 8 * MiB, 5);
  CHECK(holds(part, 8 * MiB, 5));
  CHECK(cp_free(fx.pool, part) == CP_OK);
  CHECK(empty_cache_idle(&fx) == CP_OK);
  CHECK_EQ_U(cp_sim_vmm_page_bytes(fx.sim), reserved_of(&fx));
  CHECK_EQ_U(reserved_of(&fx), 16 * MiB); /* the four live blocks' pages only */
  for (int i = 0; i < 4; i++) CHECK(cp_free(fx.pool, live[i]) == CP_OK);
  fx_close(&fx);
}

int main(void) {
  RUN(config_key);
  RUN(one_range_serves_both_sizes_in_single_pages);
  RUN(scattered_free_pages_serve_a_large_request);
  RUN(kept_range_is_reused_without_device_calls);
  RUN(top_up_maps_only_the_missing_pages);
  RUN(streams_keep_their_pages);
  RUN(empty_cache_drops_idle_ranges_and_unmaps_free_pages);
  RUN(idle_ranges_wait_for_the_work_queued_on_them);
  RUN(trimmed_ranges_wait_for_the_work_queued_on_them);
  RUN(oom_retry_waits_for_its_stream_not_the_device);
  RUN(oom_retry_drops_idle_ranges);
  RUN(failures_of_each_stitching_call);
  RUN(range_unmapped_but_not_given_back_never_serves);
  RUN(failed_stitch_whose_undo_fails_is_given_back_later);
  RUN(pages_of_a_range_not_dropped_stay_in_their_segments);
  RUN(pool_is_whole_while_a_range_is_stitched);
  RUN(pool_is_whole_while_a_failed_stitch_is_undone);
  RUN(destroy_with_ranges_in_use);
  RUN(fallback_without_vmm);
  RUN(empty_cache_keeps_free_pages_a_range_in_use_still_maps);
  RUN(handles_in_part_use_open_and_close_a_range);
  RUN(a_handle_in_part_use_completes_whole_ones);
  RUN(partial_handles_off_stitches_whole_handles_only);
  return check_summary("test_stitch");
}
