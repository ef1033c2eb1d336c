/* test_expand.c — page-mapped segments (expandable_segments:True, core/expand.c) on the
 * simulated device with real memory: growth in place, reuse, streams, pending frees,
 * empty_cache, out-of-memory, injected failures of every page-mapped call, destroy. The ASan
 * build runs the invariant checker after every operation. */
#include <string.h>

#include "check.h"
#include "fixture.h"

#define ES "expandable_segments:True"

TEST(grows_in_place) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 256 * MiB, ES) == 0);
  CHECK(info_of(&fx).page_mapped == 1);
  char *a = must_alloc(&fx, 4 * MiB, 0);
  CHECK_EQ_U(reserved_of(&fx), 20 * MiB); /* one large chunk */
  CHECK_EQ_U(info_of(&fx).page_segments, 1);
  CHECK_EQ_U(info_of(&fx).address_space, (256 * MiB + 32 * MiB + 20 * MiB - 1) / (20 * MiB) * (20 * MiB));
  char *b = must_alloc(&fx, 4 * MiB, 0);
  CHECK(b == a + 4 * MiB); /* right after the first, in the same segment */
  CHECK_EQ_U(reserved_of(&fx), 20 * MiB);
  char *c = must_alloc(&fx, 16 * MiB, 0); /* 12 MiB free at the end: one more chunk */
  CHECK(c == a + 8 * MiB);
  CHECK_EQ_U(reserved_of(&fx), 40 * MiB);
  CHECK_EQ_U(info_of(&fx).page_segments, 1);
  cp_stats_t s = stats_of(&fx);
  CHECK_EQ_U(s.family[CP_STAT_SEGMENT][CP_KIND_ALL].current, 0); /* as torch counts them */
  CHECK_EQ_U(s.num_device_alloc, 2);
  CHECK_EQ_U(info_of(&fx).device_map, 2);
  CHECK_EQ_U(cp_sim_vmm_mapped_bytes(fx.sim), 40 * MiB);
  /* A large request grows the same segment, mapping chunks at its end. */
  char *d = must_alloc(&fx, 50 * MiB, 0);
  CHECK(d == a + 24 * MiB);
  CHECK_EQ_U(reserved_of(&fx), 80 * MiB);
  CHECK_EQ_U(cp_sim_vmm_mapped_bytes(fx.sim), reserved_of(&fx));
  /* The small pool has a segment of its own, in 2 MiB chunks. */
  char *e = must_alloc(&fx, 1000, 0);
  CHECK_EQ_U(reserved_of(&fx), 82 * MiB);
  CHECK_EQ_U(info_of(&fx).page_segments, 2);
  char *f = must_alloc(&fx, 1000, 0);
  CHECK(f == e + 1024);
  fill(a, 4 * MiB, 1);
  fill(d, 50 * MiB, 2);
  CHECK(holds(a, 4 * MiB, 1) && holds(d, 50 * MiB, 2));
  fx_close(&fx); /* destroy with live blocks */
}

TEST(reuse_free_and_merge) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 256 * MiB, ES) == 0);
  char *a = must_alloc(&fx, 4 * MiB, 0);
  char *b = must_alloc(&fx, 4 * MiB, 0);
  char *c = must_alloc(&fx, 4 * MiB, 0);
  CHECK(cp_free(fx.pool, b) == CP_OK);
  char *b2 = must_alloc(&fx, 3 * MiB, 0); /* best fit: the hole, split */
  CHECK(b2 == b);
  CHECK(cp_free(fx.pool, b2) == CP_OK);
  CHECK(cp_free(fx.pool, a) == CP_OK);
  CHECK(cp_free(fx.pool, c) == CP_OK); /* all merged into one free block */
  CHECK_EQ_U(info_of(&fx).free_blocks, 1);
  CHECK_EQ_U(reserved_of(&fx), 20 * MiB); /* nothing unmapped on free */
  char *d = must_alloc(&fx, 20 * MiB, 0);
  CHECK(d == a);
  CHECK_EQ_U(reserved_of(&fx), 20 * MiB);
  CHECK(cp_free(fx.pool, d) == CP_OK);
  fx_close(&fx);
}

TEST(one_segment_per_stream_and_kind) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 256 * MiB, ES) == 0);
  char *a1 = must_alloc(&fx, 4 * MiB, 1);
  char *a2 = must_alloc(&fx, 4 * MiB, 2);
  char *b1 = must_alloc(&fx, 4 * MiB, 1);
  char *s1 = must_alloc(&fx, 4096, 1);
  CHECK(b1 == a1 + 4 * MiB);
  CHECK(a2 != a1 + 8 * MiB);
  CHECK_EQ_U(info_of(&fx).page_segments, 3);
  CHECK_EQ_U(reserved_of(&fx), 42 * MiB);
  /* A free block of stream 1 does not serve stream 2. */
  CHECK(cp_free(fx.pool, b1) == CP_OK);
  char *c2 = must_alloc(&fx, 4 * MiB, 2);
  CHECK(c2 == a2 + 4 * MiB);
  (void)s1;
  fx_close(&fx);
}

TEST(pending_frees_wait_for_their_events) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 256 * MiB, ES) == 0);
  char *a = must_alloc(&fx, 20 * MiB, 0);
  CHECK(cp_record_stream(fx.pool, a, 7) == CP_OK);
  launch(&fx, 7, a, 1);
  launch(&fx, 7, a, 20 * MiB);
  CHECK(cp_free(fx.pool, a) == CP_OK);
  CHECK_EQ_U(info_of(&fx).pending_blocks, 1);
  CHECK(!cp_sim_stream_idle(fx.sim, 7));
  /* Not reusable, and still mapped, while the event is pending. */
  char *b = must_alloc(&fx, 20 * MiB, 0);
  CHECK(b == a + 20 * MiB);
  CHECK_EQ_U(reserved_of(&fx), 40 * MiB);
  CHECK(cp_free(fx.pool, b) == CP_OK);
  /* empty_cache waits for the event first, then unmaps every whole free chunk. */
  CHECK(empty_cache_idle(&fx) == CP_OK);
  CHECK(cp_sim_stream_idle(fx.sim, 7));
  CHECK_EQ_U(info_of(&fx).pending_blocks, 0);
  CHECK_EQ_U(reserved_of(&fx), 0);
  CHECK_EQ_U(cp_sim_vmm_mapped_bytes(fx.sim), 0);
  CHECK_EQ_U(info_of(&fx).page_segments, 0); /* wholly unmapped: address space given back */
  CHECK_EQ_U(cp_sim_vmm_ranges(fx.sim), 0);
  fx_close(&fx);
}

TEST(empty_cache_unmaps_whole_free_chunks_and_keeps_live_data) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 256 * MiB, ES) == 0);
  char *a = must_alloc(&fx, 4 * MiB, 0);
  char *b = must_alloc(&fx, 60 * MiB, 0);
  char *c = must_alloc(&fx, 4 * MiB, 0);
  CHECK(c == b + 60 * MiB);
  CHECK_EQ_U(reserved_of(&fx), 80 * MiB);
  fill(a, 4 * MiB, 3);
  fill(c, 4 * MiB, 4);
  CHECK(cp_free(fx.pool, b) == CP_OK);
  /* b is [4, 64) MiB: the chunks [20, 40) and [40, 60) are wholly free; the rest of the
   * last chunk [60, 80) holds c and the free tail [72, 80). */
  CHECK(empty_cache_idle(&fx) == CP_OK);
  CHECK_EQ_U(reserved_of(&fx), 40 * MiB);
  CHECK_EQ_U(cp_sim_vmm_mapped_bytes(fx.sim), 40 * MiB);
  CHECK_EQ_U(info_of(&fx).device_unmap, 1);
  CHECK_EQ_U(stats_of(&fx).num_device_free, 1);
  CHECK(holds(a, 4 * MiB, 3));
  CHECK(holds(c, 4 * MiB, 4));
  /* The hole is filled again first (lowest address with room). */
  char *d = must_alloc(&fx, 50 * MiB, 0);
  CHECK(d == a + 4 * MiB);
  CHECK_EQ_U(reserved_of(&fx), 80 * MiB);
  fill(d, 50 * MiB, 5);
  CHECK(holds(d, 50 * MiB, 5) && holds(a, 4 * MiB, 3) && holds(c, 4 * MiB, 4));
  fx_close(&fx);
}

TEST(oom_at_capacity_then_recovery) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 60 * MiB, ES) == 0); /* three large chunks */
  char *p[3];
  for (int i = 0; i < 3; i++) p[i] = must_alloc(&fx, 20 * MiB, 0);
  CHECK_EQ_U(reserved_of(&fx), 60 * MiB);
  void *q = NULL;
  CHECK(cp_alloc(fx.pool, 20 * MiB, 0, &q) == CP_ERR_OOM);
  cp_stats_t s = stats_of(&fx);
  CHECK_EQ_U(s.num_ooms, 1);
  CHECK_EQ_U(s.num_alloc_retries, 1);
  CHECK_EQ_U(reserved_of(&fx), 60 * MiB);
  CHECK_EQ_U(cp_sim_vmm_mapped_bytes(fx.sim), 60 * MiB);
  /* Small memory cannot be had either while the large segment holds it all... */
  CHECK(cp_alloc(fx.pool, 4096, 0, &q) == CP_ERR_OOM);
  /* ...until the retry unmaps a wholly free chunk of the large segment. */
  CHECK(cp_free(fx.pool, p[1]) == CP_OK);
  void *small = must_alloc(&fx, 4096, 0);
  CHECK_EQ_U(reserved_of(&fx), 42 * MiB);
  CHECK(cp_free(fx.pool, small) == CP_OK);
  q = must_alloc(&fx, 16 * MiB, 0); /* the retry unmaps the small chunk; the hole is mapped again */
  CHECK(q == p[0] + 20 * MiB);
  CHECK_EQ_U(reserved_of(&fx), 60 * MiB);
  CHECK_EQ_U(stats_of(&fx).num_alloc_retries, 4);
  CHECK(cp_free(fx.pool, q) == CP_OK);
  fx_close(&fx);
}

/* Fail the next call of `kind` while growing by three chunks: the pool stays consistent, what
 * was mapped is counted, nothing leaks, and the next try works. */
static void fail_while_mapping(cp_sim_call_t kind, uint64_t nth, int status) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 256 * MiB, ES) == 0);
  void *keep = must_alloc(&fx, 1 * MiB + 512, 0); /* the segment exists, one chunk mapped */
  cp_sim_fail_nth(fx.sim, kind, nth, status);
  void *p = NULL;
  int rc = cp_alloc(fx.pool, 70 * MiB, 0, &p);
  if (status == CP_ERR_OOM) { /* the retry gives the chunks back and maps them again */
    CHECK(rc == CP_OK);
    CHECK_EQ_U(stats_of(&fx).num_alloc_retries, 1);
    CHECK(cp_free(fx.pool, p) == CP_OK);
  } else {
    CHECK(rc == status);
    CHECK(p == NULL);
  }
  CHECK_EQ_U(cp_pool_check(fx.pool, stderr), 0);
  CHECK_EQ_U(cp_sim_vmm_mapped_bytes(fx.sim), reserved_of(&fx));
  CHECK_EQ_U(cp_sim_vmm_page_bytes(fx.sim), reserved_of(&fx));
  p = must_alloc(&fx, 70 * MiB, 0);
  CHECK_EQ_U(cp_sim_vmm_mapped_bytes(fx.sim), reserved_of(&fx));
  fill(p, 70 * MiB, 9);
  CHECK(holds(p, 70 * MiB, 9));
  CHECK(cp_free(fx.pool, p) == CP_OK);
  CHECK(cp_free(fx.pool, keep) == CP_OK);
  CHECK(empty_cache_idle(&fx) == CP_OK);
  CHECK_EQ_U(reserved_of(&fx), 0);
  fx_close(&fx);
}

TEST(failures_of_each_mapping_call) {
  const cp_sim_call_t kinds[] = {CP_SIM_PAGE_CREATE, CP_SIM_PAGE_MAP, CP_SIM_PAGE_SET_ACCESS};
  for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
    for (uint64_t nth = 1; nth <= 3; nth++) fail_while_mapping(kinds[k], nth, CP_ERR_BACKEND);
  }
  fail_while_mapping(CP_SIM_PAGE_CREATE, 2, CP_ERR_OOM);
  /* set_access refused and the unmap undoing it refused once: the unmap is tried again, so
   * nothing stays mapped without access (a block there would fault when touched). */
  fixture_t fx;
  REQUIRE(fx_open(&fx, 256 * MiB, ES) == 0);
  cp_sim_fail_nth(fx.sim, CP_SIM_PAGE_SET_ACCESS, 1, CP_ERR_BACKEND);
  cp_sim_fail_nth(fx.sim, CP_SIM_PAGE_UNMAP, 1, CP_ERR_BACKEND);
  void *p = NULL;
  CHECK(cp_alloc(fx.pool, 4 * MiB, 0, &p) == CP_ERR_BACKEND);
  CHECK_EQ_U(reserved_of(&fx), 0);
  CHECK_EQ_U(cp_sim_vmm_mapped_bytes(fx.sim), 0);
  p = must_alloc(&fx, 4 * MiB, 0);
  fill(p, 4 * MiB, 3);
  CHECK(holds(p, 4 * MiB, 3));
  CHECK(cp_free(fx.pool, p) == CP_OK);
  fx_close(&fx);
  /* The same in a stitching pool, whose pages get access once per growth. */
  REQUIRE(fx_open(&fx, 256 * MiB, "page_stitching:True") == 0);
  cp_sim_fail_nth(fx.sim, CP_SIM_PAGE_SET_ACCESS, 1, CP_ERR_BACKEND);
  cp_sim_fail_nth(fx.sim, CP_SIM_PAGE_UNMAP, 1, CP_ERR_BACKEND);
  p = NULL;
  CHECK(cp_alloc(fx.pool, 5 * MiB, 0, &p) == CP_ERR_BACKEND);
  CHECK_EQ_U(reserved_of(&fx), 0);
  CHECK_EQ_U(cp_sim_vmm_pages(fx.sim), 0);
  p = must_alloc(&fx, 5 * MiB, 0);
  fill(p, 5 * MiB, 4);
  CHECK(holds(p, 5 * MiB, 4));
  CHECK(cp_free(fx.pool, p) == CP_OK);
  fx_close(&fx);
}

TEST(failure_of_unmap_keeps_the_memory) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 256 * MiB, ES) == 0);
  void *a = must_alloc(&fx, 4 * MiB, 0);
  void *b = must_alloc(&fx, 40 * MiB, 0);
  CHECK(cp_free(fx.pool, b) == CP_OK);
  const size_t before = reserved_of(&fx);
  cp_sim_fail_nth(fx.sim, CP_SIM_PAGE_UNMAP, 1, CP_ERR_BACKEND);
  CHECK(empty_cache_idle(&fx) == CP_ERR_BACKEND);
  CHECK_EQ_U(reserved_of(&fx), before);
  CHECK_EQ_U(cp_sim_vmm_mapped_bytes(fx.sim), before);
  void *c = must_alloc(&fx, 40 * MiB, 0); /* the memory is still the pool's */
  CHECK(c == b);
  CHECK_EQ_U(reserved_of(&fx), before);
  CHECK(cp_free(fx.pool, c) == CP_OK);
  CHECK(empty_cache_idle(&fx) == CP_OK);
  CHECK_EQ_U(reserved_of(&fx), 20 * MiB);
  CHECK(cp_free(fx.pool, a) == CP_OK);
  /* Whether the stream's work is done could not be asked: nothing is unmapped. */
  cp_sim_fail_nth(fx.sim, CP_SIM_EVENT_QUERY, 1, CP_ERR_BACKEND);
  CHECK(empty_cache_idle(&fx) == CP_ERR_BACKEND);
  CHECK_EQ_U(reserved_of(&fx), 20 * MiB);
  CHECK(empty_cache_idle(&fx) == CP_OK);
  CHECK_EQ_U(reserved_of(&fx), 0);
  fx_close(&fx);
}

TEST(failure_of_page_release_leaks_no_page) {
  /* page_release refused once after a chunk was mapped: the pool does not try again (the
   * handle may be gone; a second release would be a fault), keeps the mapping, and the page
   * goes with the unmap. */
  fixture_t fx;
  REQUIRE(fx_open(&fx, 256 * MiB, ES) == 0);
  cp_sim_fail_nth(fx.sim, CP_SIM_PAGE_RELEASE, 1, CP_ERR_BACKEND);
  void *p = must_alloc(&fx, 4 * MiB, 0);
  CHECK_EQ_U(cp_sim_vmm_pages(fx.sim), 1);
  CHECK(cp_free(fx.pool, p) == CP_OK);
  CHECK(empty_cache_idle(&fx) == CP_OK);
  CHECK_EQ_U(reserved_of(&fx), 0);
  CHECK_EQ_U(cp_sim_vmm_pages(fx.sim), 0);
  CHECK_EQ_U(cp_sim_reserved_bytes(fx.sim), 0);
  /* page_map refused, and the release of the page it could not map refused too. */
  cp_sim_fail_nth(fx.sim, CP_SIM_PAGE_MAP, 1, CP_ERR_BACKEND);
  cp_sim_fail_nth(fx.sim, CP_SIM_PAGE_RELEASE, 1, CP_ERR_BACKEND);
  p = NULL;
  CHECK(cp_alloc(fx.pool, 4 * MiB, 0, &p) == CP_ERR_BACKEND);
  CHECK_EQ_U(cp_sim_vmm_pages(fx.sim), 0);
  CHECK_EQ_U(cp_sim_reserved_bytes(fx.sim), 0);
  p = must_alloc(&fx, 4 * MiB, 0);
  CHECK(cp_free(fx.pool, p) == CP_OK);
  fx_close(&fx);
}

TEST(failure_of_event_destroy_leaks_no_event) {
  /* The drain event comes from the pool's spares and goes back to them; at destroy, a
   * refused destroy is not tried again (the handle is gone either way: a second destroy would
   * be a use after free), and the device keeps no event. */
  fixture_t fx;
  REQUIRE(fx_open(&fx, 256 * MiB, ES) == 0);
  void *p = must_alloc(&fx, 4 * MiB, 0);
  CHECK(cp_free(fx.pool, p) == CP_OK);
  CHECK(empty_cache_idle(&fx) == CP_OK);
  CHECK_EQ_U(reserved_of(&fx), 0);
  CHECK_EQ_U(cp_sim_live_events(fx.sim), 1); /* the spare */
  cp_sim_fail_nth(fx.sim, CP_SIM_EVENT_DESTROY, 1, CP_ERR_BACKEND);
  fx_close(&fx); /* no fault, no event left */
}

TEST(va_reserve_failure_and_fallback_without_vmm) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 256 * MiB, ES) == 0);
  cp_sim_fail_nth(fx.sim, CP_SIM_VA_RESERVE, 1, CP_ERR_BACKEND);
  void *p = NULL;
  CHECK(cp_alloc(fx.pool, 4 * MiB, 0, &p) == CP_ERR_BACKEND);
  CHECK_EQ_U(info_of(&fx).page_segments, 0);
  p = must_alloc(&fx, 4 * MiB, 0);
  fx_close(&fx);
  /* A device without page-mapped memory: plain segments, and info says so. */
  REQUIRE(fx_open_sim(&fx, 256 * MiB, CP_SIM_NO_VMM, ES) == 0);
  CHECK(info_of(&fx).page_mapped == 0);
  p = must_alloc(&fx, 4 * MiB, 0);
  CHECK_EQ_U(reserved_of(&fx), 20 * MiB);
  CHECK_EQ_U(stats_of(&fx).family[CP_STAT_SEGMENT][CP_KIND_ALL].current, 1);
  CHECK_EQ_U(info_of(&fx).page_segments, 0);
  fx_close(&fx);
}

TEST(torch_best_fit_skips_the_growable_tail) {
  /* Free blocks: a 6 MiB hole at [4, 10) MiB and the tail [14.5, 20) of 5.5 MiB before
   * unmapped space. A 5 MiB request takes the hole although the tail is smaller: the tail
   * could grow, so it ranks by the size it could grow to. */
  fixture_t fx;
  REQUIRE(fx_open(&fx, 256 * MiB, ES) == 0);
  char *a = must_alloc(&fx, 4 * MiB, 0);
  char *b = must_alloc(&fx, 6 * MiB, 0);
  char *c = must_alloc(&fx, 4 * MiB + 512 * KiB, 0);
  CHECK(cp_free(fx.pool, b) == CP_OK);
  char *d = must_alloc(&fx, 5 * MiB, 0);
  CHECK(d == b);
  /* With no other free block large enough, the tail serves. */
  char *e = must_alloc(&fx, 5 * MiB, 0);
  CHECK(e == c + 4 * MiB + 512 * KiB);
  CHECK_EQ_U(reserved_of(&fx), 20 * MiB);
  (void)a;
  fx_close(&fx);
}

int main(void) {
  RUN(grows_in_place);
  RUN(reuse_free_and_merge);
  RUN(one_segment_per_stream_and_kind);
  RUN(pending_frees_wait_for_their_events);
  RUN(empty_cache_unmaps_whole_free_chunks_and_keeps_live_data);
  RUN(oom_at_capacity_then_recovery);
  RUN(failures_of_each_mapping_call);
  RUN(failure_of_unmap_keeps_the_memory);
  RUN(failure_of_page_release_leaks_no_page);
  RUN(failure_of_event_destroy_leaks_no_event);
  RUN(va_reserve_failure_and_fallback_without_vmm);
  RUN(torch_best_fit_skips_the_growable_tail);
  return check_summary("test_expand");
}
