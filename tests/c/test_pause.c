/* test_pause.c — regions (core/region.c) and their pause and resume (core/pause.c) on the
 * simulated device with real memory: a region's allocations never share memory with others,
 * a pause waits for the region's streams (and only those), gives back every page of the
 * region and keeps its addresses, a backup brings every byte back at the same address, the
 * device calls are counted, a failure of any call leaves the region paused or not (never
 * between) with nothing leaked, and threads pause, resume, allocate and free at once. The
 * ASan build runs the invariant checker after every operation. */
#include <inttypes.h>
#include <pthread.h>
#include <stdbool.h>
#include <string.h>

#include "check.h"
#include "core/snapshot.h"
#include "fixture.h"

#define ST "expandable_segments:True,page_stitching:True"
#define EX "expandable_segments:True"

static uint32_t region(const char *name) {
  uint32_t id = 0;
  CHECK(cp_region_id(name, &id) == CP_OK);
  return id;
}

static void *alloc_in(fixture_t *fx, uint32_t tag, size_t size, cp_stream_t stream) {
  void *p = NULL;
  const int rc = cp_alloc_in(fx->pool, size, stream, tag, &p);
  if (rc != CP_OK) fprintf(stderr, "alloc_in(%zu) failed: %s\n", size, cp_last_error());
  CHECK(rc == CP_OK);
  CHECK(p != NULL);
  if (p != NULL) CHECK_EQ_U(cp_sim_check_handoff(fx->sim, stream, (uintptr_t)p, size), 0);
  return p;
}

static cp_region_info_t region_info(fixture_t *fx, uint32_t tag) {
  cp_region_info_t out[CP_REGION_MAX];
  const size_t n = cp_pool_regions(fx->pool, out, CP_REGION_MAX);
  for (size_t i = 0; i < n && i < CP_REGION_MAX; i++) {
    if (out[i].tag == tag) return out[i];
  }
  cp_region_info_t none;
  memset(&none, 0, sizeof none);
  return none;
}

static uint64_t calls(fixture_t *fx, cp_sim_call_t kind) { return cp_sim_calls(fx->sim, kind); }

/* No host memory of backups left on the device's books. */
static void no_host_memory_left(fixture_t *fx) { CHECK_EQ_U(cp_sim_host_allocations(fx->sim, NULL), 0); }

TEST(names) {
  uint32_t a = 0, b = 0;
  CHECK(cp_region_id("kv_cache", &a) == CP_OK);
  CHECK(cp_region_id("kv_cache", &b) == CP_OK);
  CHECK(a != 0 && a == b);
  CHECK(strcmp(cp_region_name(a), "kv_cache") == 0);
  CHECK(cp_region_name(0) == NULL);
  CHECK(cp_region_name(CP_REGION_MAX + 1) == NULL);
  CHECK(cp_region_id("", &b) == CP_ERR_INVALID);
  CHECK(contains(cp_last_error(), "1 to 127 characters"));
  CHECK(cp_region_id("a\nb", &b) == CP_ERR_INVALID);
  char longname[200];
  memset(longname, 'x', sizeof longname - 1);
  longname[sizeof longname - 1] = 0;
  CHECK(cp_region_id(longname, &b) == CP_ERR_INVALID);
  CHECK(cp_region_id(NULL, &b) == CP_ERR_INVALID);
  CHECK(cp_region_of_thread() == 0);
  CHECK(cp_region_enter(a) == 0);
  CHECK(cp_region_of_thread() == a);
  CHECK(cp_region_enter(0) == a);
}

TEST(regions_never_share_memory) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 512 * MiB, ST) == 0);
  const uint32_t kv = region("kv_cache"), w = region("weights");
  char *u = must_alloc(&fx, 1 * MiB, 0);
  char *k = alloc_in(&fx, kv, 1 * MiB, 0);
  char *x = alloc_in(&fx, w, 1 * MiB, 0);
  /* Each in a page-mapped segment of its own: far apart, never one page. */
  void *bu = NULL, *bk = NULL, *bx = NULL;
  CHECK(cp_pool_base_of(fx.pool, u, &bu, NULL) == CP_PTR_LIVE);
  CHECK(cp_pool_base_of(fx.pool, k, &bk, NULL) == CP_PTR_LIVE);
  CHECK(cp_pool_base_of(fx.pool, x, &bx, NULL) == CP_PTR_LIVE);
  CHECK(info_of(&fx).page_segments == 3);
  cp_snapshot_t snap;
  CHECK(cp_pool_snapshot(fx.pool, &snap) == CP_OK);
  size_t tagged = 0;
  for (size_t i = 0; i < snap.segment_count; i++) tagged += snap.segments[i].tag == kv || snap.segments[i].tag == w;
  CHECK_EQ_U(tagged, 2);
  cp_snapshot_free(&snap);
  /* Freed memory of one region never serves another. */
  CHECK(cp_free(fx.pool, k) == CP_OK);
  char *again = must_alloc(&fx, 1 * MiB, 0);
  CHECK(again != k);
  char *k2 = alloc_in(&fx, kv, 1 * MiB, 0);
  CHECK(k2 == k);
  cp_region_info_t ri = region_info(&fx, kv);
  CHECK_EQ_U(ri.live_bytes, 1 * MiB);
  CHECK_EQ_U(ri.live_blocks, 1);
  CHECK_EQ_U(ri.reserved, 2 * MiB);
  CHECK_EQ_U(ri.segments, 1);
  CHECK(!ri.paused);
  CHECK(cp_free(fx.pool, u) == CP_OK);
  CHECK(cp_free(fx.pool, again) == CP_OK);
  CHECK(cp_free(fx.pool, k2) == CP_OK);
  CHECK(cp_free(fx.pool, x) == CP_OK);
  fx_close(&fx);
}

/* Live blocks of region `tag`: a big one, two small ones, with patterns. */
typedef struct held_s {
  char *p[3];
  size_t n[3];
} held_t;

static held_t fill_region(fixture_t *fx, uint32_t tag, cp_stream_t stream) {
  held_t h = {{NULL, NULL, NULL}, {40 * MiB, 3 * MiB + 100, 5000}};
  for (int i = 0; i < 3; i++) {
    h.p[i] = alloc_in(fx, tag, h.n[i], stream);
    if (h.p[i] != NULL) fill(h.p[i], h.n[i], (unsigned char)(30 + i));
  }
  return h;
}

static void check_region(const held_t *h) {
  for (int i = 0; i < 3; i++) CHECK(holds(h->p[i], h->n[i], (unsigned char)(30 + i)));
}

static void free_region(fixture_t *fx, const held_t *h) {
  for (int i = 0; i < 3; i++) CHECK(cp_free(fx->pool, h->p[i]) == CP_OK);
}

static void pause_and_resume_keep_every_byte(const char *conf) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 512 * MiB, conf) == 0);
  const uint32_t kv = region("kv_cache");
  char *untagged = must_alloc(&fx, 8 * MiB, 0);
  fill(untagged, 8 * MiB, 3);
  held_t h = fill_region(&fx, kv, 0);
  const size_t reserved = reserved_of(&fx);
  const cp_region_info_t before = region_info(&fx, kv);
  CHECK(before.reserved > 0);
  const size_t device = cp_sim_reserved_bytes(fx.sim);

  CHECK(cp_pool_pause(fx.pool, kv, CP_PAUSE_BACKUP) == CP_OK);
  const cp_region_info_t paused = region_info(&fx, kv);
  CHECK(paused.paused);
  CHECK_EQ_U(paused.reserved, 0);                   /* every page of it: >= 99 % */
  CHECK_EQ_U(paused.paused_bytes, before.reserved); /* what resume maps again */
  CHECK_EQ_U(paused.live_bytes, before.live_bytes); /* the blocks are still live */
  CHECK_EQ_U(paused.backup_bytes, h.n[0] + h.n[1] + h.n[2]);
  CHECK_EQ_U(reserved_of(&fx), reserved - before.reserved);
  CHECK_EQ_U(cp_sim_reserved_bytes(fx.sim), device - before.reserved); /* the device has it back */
  CHECK_EQ_U(info_of(&fx).paused_bytes, before.reserved);
  CHECK_EQ_U(cp_sim_host_allocations(fx.sim, NULL), 3);
  /* Nothing in it can be allocated; the rest of the pool serves as before. */
  void *p = NULL;
  CHECK(cp_alloc_in(fx.pool, 1000, 0, kv, &p) == CP_ERR_STATE);
  CHECK(contains(cp_last_error(), "region \"kv_cache\" is paused"));
  CHECK(p == NULL);
  CHECK(holds(untagged, 8 * MiB, 3));
  /* Touching it now is a device fault, as on a GPU. */
  CHECK(cp_sim_launch(fx.sim, 5, (uintptr_t)h.p[0], 4096) == CP_ERR_INVALID);
  CHECK_EQ_U(cp_sim_device_faults(fx.sim), 1);
  cp_sim_clear_device_faults(fx.sim);
  /* A second pause leaves it as it is. */
  CHECK(cp_pool_pause(fx.pool, kv, CP_PAUSE_BACKUP) == CP_OK);
  CHECK_EQ_U(cp_sim_host_allocations(fx.sim, NULL), 3);

  CHECK(cp_pool_resume(fx.pool, kv) == CP_OK);
  const cp_region_info_t after = region_info(&fx, kv);
  CHECK(!after.paused);
  CHECK_EQ_U(after.reserved, before.reserved);
  CHECK_EQ_U(after.backup_bytes, 0);
  CHECK_EQ_U(reserved_of(&fx), reserved);
  check_region(&h); /* same addresses, same bytes */
  no_host_memory_left(&fx);
  /* Usable as before: work on it, a new allocation in it. */
  launch(&fx, 0, h.p[0], 40 * MiB);
  char *more = alloc_in(&fx, kv, 2 * MiB, 0);
  CHECK(cp_free(fx.pool, more) == CP_OK);
  CHECK(cp_pool_resume(fx.pool, kv) == CP_OK); /* not paused: nothing to do */
  free_region(&fx, &h);
  CHECK(cp_free(fx.pool, untagged) == CP_OK);
  fx_close(&fx);
}

TEST(pause_and_resume_keep_every_byte_stitching) { pause_and_resume_keep_every_byte(ST); }
TEST(pause_and_resume_keep_every_byte_expandable) { pause_and_resume_keep_every_byte(EX); }

TEST(pause_waits_for_the_regions_streams_only) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 512 * MiB, ST) == 0);
  const uint32_t kv = region("kv_cache");
  held_t h = fill_region(&fx, kv, 7);
  char *other = must_alloc(&fx, 4 * MiB, 11);
  /* Work still queued on the region's memory: on its stream, and on a stream it was recorded
   * on; and work of an unrelated stream. */
  launch(&fx, 7, h.p[0], 40 * MiB);
  CHECK(cp_record_stream(fx.pool, h.p[1], 9) == CP_OK);
  launch(&fx, 9, h.p[1], h.n[1]);
  launch(&fx, 11, other, 4 * MiB);
  CHECK(cp_pool_pause(fx.pool, kv, CP_PAUSE_BACKUP) == CP_OK);
  fx_no_faults(fx.sim); /* unmapped only after that work was done */
  CHECK(cp_sim_stream_idle(fx.sim, 7) == 1);
  CHECK(cp_sim_stream_idle(fx.sim, 9) == 1);
  CHECK_EQ_U(cp_sim_queued_launches(fx.sim), 1); /* not the whole device: stream 11 still runs */
  CHECK_EQ_U(calls(&fx, CP_SIM_RELEASE), 0);
  CHECK(cp_pool_resume(fx.pool, kv) == CP_OK);
  check_region(&h);
  free_region(&fx, &h);
  CHECK(cp_free(fx.pool, other) == CP_OK);
  fx_close(&fx);
}

TEST(frees_while_paused) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 512 * MiB, ST) == 0);
  const uint32_t kv = region("kv_cache");
  held_t h = fill_region(&fx, kv, 0);
  CHECK(cp_record_stream(fx.pool, h.p[2], 4) == CP_OK);
  CHECK(cp_pool_pause(fx.pool, kv, 0) == CP_OK);
  char *busy = must_alloc(&fx, 1 * MiB, 4);
  launch(&fx, 4, busy, 1 * MiB);
  CHECK(cp_free(fx.pool, h.p[0]) == CP_OK); /* host bookkeeping only */
  CHECK(cp_free(fx.pool, h.p[2]) == CP_OK); /* an event on stream 4, behind its work: pending */
  CHECK(cp_empty_cache(fx.pool) == CP_OK);  /* touches nothing of a paused region */
  fx_no_faults(fx.sim);
  CHECK_EQ_U(region_info(&fx, kv).live_blocks, 2);
  CHECK(cp_pool_resume(fx.pool, kv) == CP_OK);
  cp_sim_complete_all(fx.sim);
  char *p = alloc_in(&fx, kv, 40 * MiB, 0); /* the freed block serves again */
  CHECK(p == h.p[0]);
  CHECK(cp_free(fx.pool, p) == CP_OK);
  CHECK(cp_free(fx.pool, h.p[1]) == CP_OK);
  CHECK(cp_free(fx.pool, busy) == CP_OK);
  CHECK(empty_cache_idle(&fx) == CP_OK);
  CHECK_EQ_U(region_info(&fx, kv).reserved, 0);
  fx_close(&fx);
}

TEST(stitched_blocks_keep_their_bytes_and_pages) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 512 * MiB, ST) == 0);
  const uint32_t kv = region("kv_cache");
  char *holes[4], *live[4];
  for (int i = 0; i < 4; i++) {
    holes[i] = alloc_in(&fx, kv, 4 * MiB, 0);
    live[i] = alloc_in(&fx, kv, 4 * MiB, 0);
    fill(live[i], 4 * MiB, (unsigned char)(50 + i));
  }
  for (int i = 0; i < 4; i++) CHECK(cp_free(fx.pool, holes[i]) == CP_OK);
  char *big = alloc_in(&fx, kv, 16 * MiB, 0); /* stitched from the four holes */
  CHECK_EQ_U(info_of(&fx).stitches, 1);
  fill(big, 16 * MiB, 9);
  CHECK(cp_pool_pause(fx.pool, kv, CP_PAUSE_BACKUP) == CP_OK);
  CHECK_EQ_U(region_info(&fx, kv).reserved, 0);
  CHECK_EQ_U(cp_sim_vmm_mappings(fx.sim), 0);
  CHECK_EQ_U(cp_sim_vmm_pages(fx.sim), 0);
  CHECK(cp_pool_resume(fx.pool, kv) == CP_OK);
  CHECK(holds(big, 16 * MiB, 9));
  for (int i = 0; i < 4; i++) CHECK(holds(live[i], 4 * MiB, (unsigned char)(50 + i)));
  /* The stitched address and the holes are one memory again, page for page. */
  for (int i = 0; i < 4; i++) {
    cp_page_t p1 = 0, p2 = 0;
    size_t o1 = 0, o2 = 0;
    CHECK(cp_sim_vmm_resolve(fx.sim, (uintptr_t)holes[i], &p1, &o1, NULL) == CP_OK);
    CHECK(cp_sim_vmm_resolve(fx.sim, (uintptr_t)(big + (size_t)i * 4 * MiB), &p2, &o2, NULL) == CP_OK);
    CHECK(p1 == p2 && o1 == o2);
  }
  CHECK(cp_free(fx.pool, big) == CP_OK);
  for (int i = 0; i < 4; i++) CHECK(cp_free(fx.pool, live[i]) == CP_OK);
  CHECK(empty_cache_idle(&fx) == CP_OK);
  fx_close(&fx);
}

/* The count: pause + resume of a 1 GiB region, on bookkeeping memory. */
TEST(calls_for_a_gibibyte) {
  fixture_t fx;
  REQUIRE(fx_open_sim(&fx, 4 * GiB, CP_SIM_NO_TOUCH, ST) == 0);
  const uint32_t kv = region("kv_cache");
  void *blocks[16];
  for (int i = 0; i < 16; i++) blocks[i] = alloc_in(&fx, kv, 64 * MiB, 0); /* one contiguous stretch */
  CHECK_EQ_U(region_info(&fx, kv).reserved, 1 * GiB);
  cp_sim_reset_counters(fx.sim);
  CHECK(cp_pool_pause(fx.pool, kv, 0) == CP_OK);
  CHECK_EQ_U(calls(&fx, CP_SIM_PAGE_UNMAP), 1);
  CHECK_EQ_U(calls(&fx, CP_SIM_EVENT_SYNCHRONIZE), 1); /* its one stream */
  CHECK_EQ_U(calls(&fx, CP_SIM_RELEASE), 0);           /* nothing waits for the whole device */
  CHECK_EQ_U(cp_sim_reserved_bytes(fx.sim), 0);
  printf("pause of 1 GiB (simulator): %" PRIu64 " unmap, %" PRIu64 " page releases, %" PRIu64 " event records\n",
         calls(&fx, CP_SIM_PAGE_UNMAP), calls(&fx, CP_SIM_PAGE_RELEASE), calls(&fx, CP_SIM_EVENT_RECORD));
  cp_sim_reset_counters(fx.sim);
  CHECK(cp_pool_resume(fx.pool, kv) == CP_OK);
  CHECK_EQ_U(calls(&fx, CP_SIM_PAGE_CREATE), 1);
  CHECK_EQ_U(calls(&fx, CP_SIM_PAGE_MAP), 1);
  CHECK_EQ_U(calls(&fx, CP_SIM_PAGE_SET_ACCESS), 1);
  CHECK_EQ_U(cp_sim_reserved_bytes(fx.sim), 1 * GiB);
  printf("resume of 1 GiB (simulator): %" PRIu64 " create, %" PRIu64 " map, %" PRIu64 " access\n",
         calls(&fx, CP_SIM_PAGE_CREATE), calls(&fx, CP_SIM_PAGE_MAP), calls(&fx, CP_SIM_PAGE_SET_ACCESS));
  for (int i = 0; i < 16; i++) CHECK(cp_free(fx.pool, blocks[i]) == CP_OK);
  /* The resumed handle is one piece: it goes back whole once all of it is free. */
  CHECK(empty_cache_idle(&fx) == CP_OK);
  CHECK_EQ_U(region_info(&fx, kv).reserved, 0);
  fx_close(&fx);
}

/* A graph's pool is paused whole (CP_PAUSE_KEEP_FREE): its free memory too, memory retired
 * and still waiting for its stream included, and all of it is mapped again. */
TEST(keep_free_pauses_every_mapped_byte) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 512 * MiB, ST) == 0);
  const uint32_t g = region("graph_like");
  char *keep = alloc_in(&fx, g, 8 * MiB, 3);
  char *tmp = alloc_in(&fx, g, 16 * MiB, 3);
  launch(&fx, 3, tmp, 16 * MiB);
  CHECK(cp_free(fx.pool, tmp) == CP_OK);
  CHECK(cp_empty_cache(fx.pool) == CP_OK); /* retired, not unmapped: stream 3 still runs */
  const size_t mapped = region_info(&fx, g).reserved;
  CHECK_EQ_U(mapped, 24 * MiB);
  CHECK(cp_pool_pause(fx.pool, g, CP_PAUSE_KEEP_FREE) == CP_OK);
  fx_no_faults(fx.sim);
  CHECK_EQ_U(region_info(&fx, g).paused_bytes, mapped);
  CHECK_EQ_U(cp_sim_reserved_bytes(fx.sim), 0);
  CHECK(cp_pool_resume(fx.pool, g) == CP_OK);
  CHECK_EQ_U(region_info(&fx, g).reserved, mapped);
  launch(&fx, 3, tmp, 16 * MiB); /* a replay on the freed intermediate's address: mapped */
  fx_no_faults(fx.sim);
  CHECK(cp_free(fx.pool, keep) == CP_OK);
  CHECK(empty_cache_idle(&fx) == CP_OK);
  CHECK_EQ_U(region_info(&fx, g).reserved, 0);
  fx_close(&fx);
}

TEST(refusals) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 256 * MiB, ST) == 0);
  const uint32_t kv = region("kv_cache");
  char *p = alloc_in(&fx, kv, 1 * MiB, 0);
  CHECK(cp_pool_capture_begin(fx.pool) == CP_OK);
  CHECK(cp_pool_pause(fx.pool, kv, 0) == CP_ERR_STATE);
  CHECK(contains(cp_last_error(), "captured"));
  CHECK(cp_pool_capture_end(fx.pool) == CP_OK);
  CHECK(cp_pool_pause(fx.pool, kv, 0) == CP_OK);
  CHECK(cp_pool_capture_begin(fx.pool) == CP_OK);
  CHECK(cp_pool_resume(fx.pool, kv) == CP_ERR_STATE);
  CHECK(cp_pool_capture_end(fx.pool) == CP_OK);
  CHECK(cp_pool_resume(fx.pool, kv) == CP_OK);
  CHECK(cp_pool_pause(NULL, kv, 0) == CP_ERR_INVALID);
  CHECK(cp_free(fx.pool, p) == CP_OK);
  fx_close(&fx);
  /* A pool of plain segments has nothing to pause; its tagged allocations are untagged. */
  REQUIRE(fx_open(&fx, 256 * MiB, "") == 0);
  p = alloc_in(&fx, kv, 1 * MiB, 0);
  CHECK(cp_pool_regions(fx.pool, NULL, 0) == 0);
  CHECK(cp_pool_pause(fx.pool, kv, 0) == CP_ERR_STATE);
  CHECK(contains(cp_last_error(), "no page-mapped memory"));
  CHECK(cp_free(fx.pool, p) == CP_OK);
  fx_close(&fx);
}

TEST(resume_without_memory_stays_paused) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 96 * MiB, ST) == 0);
  const uint32_t kv = region("kv_cache");
  held_t h = fill_region(&fx, kv, 0);
  CHECK(cp_pool_pause(fx.pool, kv, CP_PAUSE_BACKUP) == CP_OK);
  char report[2048];
  CHECK(cp_pool_oom_report(fx.pool, 1 * GiB, report, sizeof report) > 0);
  CHECK(contains(report, "Paused regions gave back 44.00 MiB"));
  char *hog = must_alloc(&fx, 80 * MiB, 0); /* the memory went to someone else */
  CHECK(cp_pool_resume(fx.pool, kv) == CP_ERR_OOM);
  CHECK(contains(cp_last_error(), "it stays paused"));
  CHECK(region_info(&fx, kv).paused);
  CHECK_EQ_U(region_info(&fx, kv).reserved, 0);
  CHECK(cp_free(fx.pool, hog) == CP_OK);
  CHECK(empty_cache_idle(&fx) == CP_OK);
  CHECK(cp_pool_resume(fx.pool, kv) == CP_OK);
  check_region(&h);
  free_region(&fx, &h);
  fx_close(&fx);
}

/* Note [Resume's ladder]: memory another region or untagged allocations only cache is given
 * back before a resume fails; memory in use is not. */
TEST(resume_takes_cached_memory_back_first) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 96 * MiB, ST) == 0);
  const uint32_t kv = region("kv_cache");
  held_t h = fill_region(&fx, kv, 0);
  CHECK(cp_pool_pause(fx.pool, kv, CP_PAUSE_BACKUP) == CP_OK);
  char *hog = must_alloc(&fx, 80 * MiB, 0);
  CHECK(cp_free(fx.pool, hog) == CP_OK);
  cp_sim_complete_all(fx.sim); /* its stream is done with it: cached, free */
  size_t allocated = 0, reserved = 0;
  cp_pool_usage(fx.pool, &allocated, &reserved);
  CHECK(reserved >= 80 * MiB); /* cached: no room for the region without giving it back */
  CHECK(cp_pool_resume(fx.pool, kv) == CP_OK);
  CHECK(!region_info(&fx, kv).paused);
  check_region(&h);
  /* In use, not cached: nothing to give back, the region stays paused and the error says so. */
  CHECK(cp_pool_pause(fx.pool, kv, CP_PAUSE_BACKUP) == CP_OK);
  hog = must_alloc(&fx, 80 * MiB, 0);
  CHECK(cp_pool_resume(fx.pool, kv) == CP_ERR_OOM);
  CHECK(contains(cp_last_error(), "it stays paused"));
  CHECK(region_info(&fx, kv).paused);
  CHECK(cp_free(fx.pool, hog) == CP_OK);
  cp_sim_complete_all(fx.sim);
  CHECK(cp_pool_resume(fx.pool, kv) == CP_OK);
  check_region(&h);
  free_region(&fx, &h);
  fx_close(&fx);
}

TEST(destroy_while_paused) {
  fixture_t fx;
  REQUIRE(fx_open(&fx, 256 * MiB, ST) == 0);
  const uint32_t kv = region("kv_cache");
  (void)fill_region(&fx, kv, 0);
  CHECK(cp_pool_pause(fx.pool, kv, CP_PAUSE_BACKUP) == CP_OK);
  fx_close(&fx); /* every page, mapping, range and event back; backups freed by destroy */
}

/* Every call a pause or resume makes, failing in turn: the region ends paused or not, whole,
 * with its bytes, and nothing is leaked. */
static void fault_sweep(const char *conf, int stage, cp_sim_call_t kind) {
  size_t refused = 0, tried = 0;
  for (uint64_t n = 1; n <= 64; n++) {
    fixture_t fx;
    REQUIRE(fx_open(&fx, 512 * MiB, conf) == 0);
    const uint32_t kv = region("kv_cache");
    held_t h = fill_region(&fx, kv, 0);
    const cp_region_info_t before = region_info(&fx, kv);
    if (stage == 1) CHECK(cp_pool_pause(fx.pool, kv, CP_PAUSE_BACKUP) == CP_OK);
    const uint64_t injected = cp_sim_faults_injected(fx.sim);
    cp_sim_fail_nth(fx.sim, kind, n, CP_ERR_BACKEND);
    const int rc = stage == 0 ? cp_pool_pause(fx.pool, kv, CP_PAUSE_BACKUP) : cp_pool_resume(fx.pool, kv);
    const bool fired = cp_sim_faults_injected(fx.sim) != injected;
    cp_sim_fail_nth(fx.sim, kind, 0, CP_OK);
    CHECK_EQ_U(cp_pool_check(fx.pool, stderr), 0);
    const cp_region_info_t ri = region_info(&fx, kv);
    if (ri.paused) {
      CHECK_EQ_U(ri.reserved, 0); /* fully paused */
      CHECK_EQ_U(ri.paused_bytes, before.reserved);
      CHECK(cp_pool_resume(fx.pool, kv) == CP_OK);
    } else {
      CHECK_EQ_U(ri.reserved, before.reserved); /* fully resumed */
      CHECK_EQ_U(ri.backup_bytes, 0);
    }
    if (rc != CP_OK) CHECK(fired);
    refused += rc != CP_OK;
    tried += fired;
    CHECK_EQ_U(region_info(&fx, kv).reserved, before.reserved);
    check_region(&h);
    no_host_memory_left(&fx);
    free_region(&fx, &h);
    fx_close(&fx);
    if (!fired) break; /* past the last call of that kind */
  }
  printf("  %s %s: %zu failures injected, %zu reported\n", stage == 0 ? "pause" : "resume", cp_sim_call_name(kind),
         tried, refused);
}

TEST(faults_of_each_call) {
  const cp_sim_call_t pause_calls[] = {
      CP_SIM_EVENT_CREATE, CP_SIM_EVENT_RECORD, CP_SIM_EVENT_SYNCHRONIZE, CP_SIM_HOST_ALLOC, CP_SIM_COPY_TO_HOST,
      CP_SIM_PAGE_UNMAP,   CP_SIM_PAGE_RELEASE, CP_SIM_HOST_FREE,         CP_SIM_PAGE_MAP,   CP_SIM_PAGE_SET_ACCESS};
  const cp_sim_call_t resume_calls[] = {CP_SIM_PAGE_CREATE,    CP_SIM_PAGE_MAP,  CP_SIM_PAGE_SET_ACCESS,
                                        CP_SIM_COPY_TO_DEVICE, CP_SIM_HOST_FREE, CP_SIM_PAGE_UNMAP,
                                        CP_SIM_PAGE_RELEASE};
  const char *confs[] = {ST, EX};
  for (int c = 0; c < 2; c++) {
    for (size_t i = 0; i < sizeof pause_calls / sizeof pause_calls[0]; i++) fault_sweep(confs[c], 0, pause_calls[i]);
    for (size_t i = 0; i < sizeof resume_calls / sizeof resume_calls[0]; i++) fault_sweep(confs[c], 1, resume_calls[i]);
  }
}

/* Threads: each allocates and frees in a region of its own and pauses and resumes it, while
 * one more pauses and resumes every region at once; the pool stays whole. A paused region's
 * memory must not be touched (on a GPU that is an illegal memory access; here the page is
 * gone), so the workers write and read their blocks under a read lock that the thread pausing
 * every region holds, for writing, from its pause to its resume. */
typedef struct worker_s {
  fixture_t *fx;
  uint32_t tag;
  int id;
  int failures;
  pthread_rwlock_t *touch; /* held to touch memory (workers) or while all is paused (pauser) */
} worker_t;

static void *worker(void *arg) {
  worker_t *w = arg;
  for (int round = 0; round < 30; round++) {
    void *p[4] = {NULL, NULL, NULL, NULL};
    pthread_rwlock_rdlock(w->touch);
    for (int i = 0; i < 4; i++) {
      const int rc = cp_alloc_in(w->fx->pool, (size_t)(i + 1) * 3 * MiB, (cp_stream_t)w->id, w->tag, &p[i]);
      if (rc != CP_OK && rc != CP_ERR_STATE) w->failures++; /* paused by the other thread: fine */
      if (rc == CP_OK) memset(p[i], w->id, 4096);
    }
    pthread_rwlock_unlock(w->touch);
    int rc = cp_pool_pause(w->fx->pool, w->tag, round % 2 ? CP_PAUSE_BACKUP : 0);
    if (rc != CP_OK) w->failures++;
    rc = cp_pool_resume(w->fx->pool, w->tag);
    if (rc != CP_OK) w->failures++;
    pthread_rwlock_rdlock(w->touch);
    for (int i = 0; i < 4; i++) {
      if (p[i] == NULL) continue;
      if (round % 2 == 1 && ((unsigned char *)p[i])[0] != (unsigned char)w->id) w->failures++;
      if (cp_free(w->fx->pool, p[i]) != CP_OK) w->failures++;
    }
    pthread_rwlock_unlock(w->touch);
  }
  return NULL;
}

static void *pauser(void *arg) {
  worker_t *w = arg;
  for (int round = 0; round < 30; round++) {
    pthread_rwlock_wrlock(w->touch);
    if (cp_pool_pause(w->fx->pool, 0, CP_PAUSE_BACKUP) != CP_OK) w->failures++;
    if (cp_pool_resume(w->fx->pool, 0) != CP_OK) w->failures++;
    pthread_rwlock_unlock(w->touch);
  }
  return NULL;
}

TEST(threads) {
  fixture_t fx;
  REQUIRE(fx_open_sim(&fx, 1 * GiB, CP_SIM_AUTO_COMPLETE, ST) == 0);
  worker_t w[4];
  pthread_t t[4];
  pthread_rwlock_t touch;
  REQUIRE(pthread_rwlock_init(&touch, NULL) == 0);
  const char *names[3] = {"t_one", "t_two", "t_three"};
  for (int i = 0; i < 4; i++) {
    w[i] = (worker_t){&fx, i < 3 ? region(names[i]) : 0, i + 1, 0, &touch};
    REQUIRE(pthread_create(&t[i], NULL, i < 3 ? worker : pauser, &w[i]) == 0);
  }
  for (int i = 0; i < 4; i++) {
    pthread_join(t[i], NULL);
    CHECK_EQ_U(w[i].failures, 0);
  }
  pthread_rwlock_destroy(&touch);
  CHECK(empty_cache_idle(&fx) == CP_OK);
  no_host_memory_left(&fx);
  fx_close(&fx);
}

/* A pause that begins while an allocation of the region has let go of the lock (its retry
 * waits for pending frees): the allocation, back under the lock, is refused as paused, maps
 * nothing for the region and hands nothing out. The wait of the retry is where the pause
 * runs here (a backend whose event_synchronize pauses the region first, once). */
static cp_backend_t racing_inner;
static cp_pool_t *racing_pool;
static uint32_t racing_tag;
static int racing_armed, racing_paused_rc = -1;

static int racing_event_synchronize(void *ctx, cp_event_t event) {
  if (racing_armed) {
    racing_armed = 0;
    racing_paused_rc = cp_pool_pause(racing_pool, racing_tag, 0);
  }
  return racing_inner.event_synchronize(ctx, event);
}

static void pause_during_an_allocation(const char *conf) {
  fixture_t fx;
  cp_config_t cfg;
  cp_config_default(&cfg);
  REQUIRE(cp_config_parse(&cfg, conf) == CP_OK);
  fx.sim = make_sim(256 * MiB, 0, &racing_inner);
  REQUIRE(fx.sim != NULL);
  fx.backend = racing_inner;
  fx.backend.event_synchronize = racing_event_synchronize;
  REQUIRE(cp_pool_create(&cfg, &fx.backend, &fx.pool) == CP_OK);
  racing_pool = fx.pool;
  racing_tag = region("racing");
  /* A block of the region used on another stream, freed: pending until that stream's work is done. */
  void *a = alloc_in(&fx, racing_tag, 8 * MiB, 1);
  CHECK(cp_record_stream(fx.pool, a, 2) == CP_OK);
  CHECK(cp_sim_launch(fx.sim, 2, (uintptr_t)a, 8 * MiB) == CP_OK);
  CHECK(cp_free(fx.pool, a) == CP_OK);
  CHECK(info_of(&fx).pending_blocks == 1);
  /* A cap at what is reserved: the next request must wait for the pending free (the retry). */
  CHECK(cp_pool_set_memory_cap(fx.pool, info_of(&fx).reserved) == CP_OK);
  racing_armed = 1;
  void *b = (void *)1;
  const int rc = cp_alloc_in(fx.pool, 16 * MiB, 1, racing_tag, &b);
  CHECK_EQ_U(racing_paused_rc, CP_OK); /* the pause ran in the retry's wait */
  CHECK_EQ_U(rc, CP_ERR_STATE);
  CHECK(contains(cp_last_error(), "paused"));
  CHECK(region_info(&fx, racing_tag).paused);
  const cp_pool_info_t in = info_of(&fx);
  CHECK_EQ_U(in.allocated, 0);
  CHECK_EQ_U(in.live_blocks, 0);
  CHECK_EQ_U(in.reserved, 0); /* nothing mapped for the paused region */
  CHECK_EQ_U(cp_pool_check(fx.pool, stderr), 0);
  CHECK(cp_pool_set_memory_cap(fx.pool, 0) == CP_OK);
  CHECK(cp_pool_resume(fx.pool, racing_tag) == CP_OK);
  void *c = alloc_in(&fx, racing_tag, 16 * MiB, 1); /* served again once resumed */
  CHECK(cp_free(fx.pool, c) == CP_OK);
  CHECK(empty_cache_idle(&fx) == CP_OK);
  fx_close(&fx);
}

TEST(pause_during_an_allocation_expandable) { pause_during_an_allocation(EX); }
TEST(pause_during_an_allocation_stitching) { pause_during_an_allocation(ST); }

TEST(several_devices) {
  fixture_t a, b;
  REQUIRE(fx_open(&a, 256 * MiB, ST) == 0);
  REQUIRE(fx_open(&b, 256 * MiB, ST) == 0);
  const uint32_t kv = region("kv_cache");
  held_t ha = fill_region(&a, kv, 0);
  char *pb = alloc_in(&b, kv, 8 * MiB, 0); /* the same region on another device */
  fill(pb, 8 * MiB, 77);
  CHECK(cp_pool_pause(a.pool, kv, CP_PAUSE_BACKUP) == CP_OK);
  CHECK(!region_info(&b, kv).paused); /* each device pauses on its own */
  CHECK(cp_pool_pause(b.pool, kv, CP_PAUSE_BACKUP) == CP_OK);
  CHECK(cp_pool_resume(a.pool, 0) == CP_OK);
  CHECK(cp_pool_resume(b.pool, 0) == CP_OK);
  check_region(&ha);
  CHECK(holds(pb, 8 * MiB, 77));
  free_region(&a, &ha);
  CHECK(cp_free(b.pool, pb) == CP_OK);
  fx_close(&a);
  fx_close(&b);
}

int main(void) {
  RUN(names);
  RUN(regions_never_share_memory);
  RUN(pause_and_resume_keep_every_byte_stitching);
  RUN(pause_and_resume_keep_every_byte_expandable);
  RUN(pause_waits_for_the_regions_streams_only);
  RUN(frees_while_paused);
  RUN(stitched_blocks_keep_their_bytes_and_pages);
  RUN(calls_for_a_gibibyte);
  RUN(keep_free_pauses_every_mapped_byte);
  RUN(refusals);
  RUN(resume_without_memory_stays_paused);
  RUN(resume_takes_cached_memory_back_first);
  RUN(destroy_while_paused);
  RUN(faults_of_each_call);
  RUN(threads);
  RUN(pause_during_an_allocation_expandable);
  RUN(pause_during_an_allocation_stitching);
  RUN(several_devices);
  return check_summary("test_pause");
}
